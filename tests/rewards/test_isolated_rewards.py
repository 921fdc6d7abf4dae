"""Reward functions in worker processes (`isolation: process`): generated code that loops, exhausts memory or
exits scores in bounded time, the trainer survives, and no process is left behind."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import psutil
import pytest

from grpo_cli.config.rewards import RewardFunctionConfig
from grpo_cli.rewards import isolated
from grpo_cli.rewards.resolve import build_reward_fns, score

HERE = Path(__file__).parent / "hanging_rewards.py"


def _children() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def _close_pools() -> None:
    for pool in isolated._POOLS.values():
        pool.close()
    isolated._POOLS.clear()


def test_code_tests_scores_a_correct_a_looping_a_memory_bomb_and_an_exiting_solution():
    before = _children()
    fns = build_reward_fns([RewardFunctionConfig(name="code_tests", isolation="process", timeout_s=2.0,
                                                 memory_mb=512, on_error=0.0, workers=4)])
    completions = ["```python\ndef add(a, b):\n    return a + b\n```",
                   "```python\ndef add(a, b):\n    while True:\n        pass\n```",
                   "```python\ndef add(a, b):\n    return len(bytearray(10**10))\n```",
                   "```python\nimport sys\nsys.exit(0)\n```",
                   "def add(a, b):\n    return a - b"]
    start = time.perf_counter()
    table, errors = score(fns, ["p"] * 5, completions, {"tests": ["assert add(2, 3) == 5"] * 5}, on_error="raise")
    took = time.perf_counter() - start
    assert [row[0] for row in table] == [1.0, 0.0, 0.0, 0.0, 0.0] and errors == 0
    assert took < 12, took  # one 2 s timeout plus worker starts, on 2 cores
    _close_pools()
    assert _children() - before == set()


def test_a_hanging_reward_and_its_children_are_killed_and_the_sample_is_missing():
    before = _children()
    fns = build_reward_fns([RewardFunctionConfig(name=f"{HERE}:hang_on_cat", isolation="process", timeout_s=1.0),
                            RewardFunctionConfig(name=f"{HERE}:leave_a_child", isolation="process", timeout_s=1.0,
                                                 on_error=-1.0)])
    start = time.perf_counter()
    table, _ = score(fns, ["p", "p"], ["the cat", "the dog"], {}, on_error="raise")
    assert time.perf_counter() - start < 8
    assert math.isnan(table[0][0]) and table[1][0] == 1.0  # on_error null: missing
    assert table[0][1] == table[1][1] == -1.0
    _close_pools()
    assert _children() - before == set()  # the grandchildren died with their process group


def test_each_call_runs_in_a_fresh_folder_with_a_scrubbed_environment(monkeypatch):
    monkeypatch.setenv("GRPO_SECRET", "x")
    fns = build_reward_fns([RewardFunctionConfig(name=f"{HERE}:where_am_i", isolation="process")])
    table, _ = score(fns, ["p"] * 2, ["a", "b"], {}, on_error="raise")
    assert [row[0] for row in table] == [1.0, 1.0]
    _close_pools()


def test_process_settings_need_process_isolation_and_code_tests_needs_it():
    with pytest.raises(ValueError, match="timeout_s apply to isolation: process only"):
        RewardFunctionConfig(name="length", timeout_s=3)
    with pytest.raises(ValueError, match="needs isolation: process"):
        RewardFunctionConfig(name="code_tests")
    inline = RewardFunctionConfig(name="length")  # a full dump (every field named) validates again
    assert RewardFunctionConfig.model_validate(inline.model_dump()) == inline


def test_a_two_step_run_with_a_hanging_reward_ends_in_bounded_time(tmp_path):
    import json

    from grpo_cli.config.load import build_config
    from grpo_cli.train.run import run_training

    cfg = build_config(overrides=["train.steps=2", "train.prompts_per_step=2", "train.generations_per_prompt=4",
                                  "train.micro_batch_size=8", "checkpoint.every_steps=0", "eval.every_steps=0",
                                  f"rewards.functions=[{{name: length}}, {{name: '{HERE}:always_hang', "
                                  "isolation: process, timeout_s: 1, workers: 4}]"])
    start = time.perf_counter()
    run_training(cfg, output_dir=str(tmp_path / "run"))
    assert time.perf_counter() - start < 60
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["reward/always_hang/mean"] is None or math.isnan(r["reward/always_hang/mean"])
                                  for r in rows), rows
    _close_pools()


def test_what_a_returning_call_started_ends_with_the_call():
    fns = build_reward_fns([RewardFunctionConfig(name=f"{HERE}:start_and_return", isolation="process")])
    table, _ = score(fns, ["p"], ["a"], {}, on_error="raise")
    pid = int(table[0][0])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {pid} started by a finished call is still running")
    _close_pools()
