"""`grpo train` with tools, 2 steps, on the rollout paths that run here: hf and vLLM colocated in this process, a
real `grpo serve-rollout` process in server mode, and Ray rollout actors (a local cluster) in async mode."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.train.run import run_training

TOOLS = f"{Path(__file__).parent / 'tools_for_tests.py'}"
SMALL = ["train.steps=2", "train.prompts_per_step=2", "train.generations_per_prompt=4", "train.micro_batch_size=8",
         "checkpoint.every_steps=0", "logging.log_completions=8", f"agent.tools=[{TOOLS}:add]",
         f"agent.tool_parser={TOOLS}:always_add", "agent.max_turns=3", "rollout.max_completion_length=64"]
"""Every finished turn counts as a call of `add` (a random-init model rarely writes one), so the rollouts take
several turns through the engine."""


def _check(run) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and sum(r["tools/calls_per_rollout"] for r in rows) > 0, rows
    assert max(r["tools/turns"] for r in rows) > 1.0 and all(r["tools/errors"] == 0 for r in rows)
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert samples and all(s["messages"][0]["role"] == "assistant" for s in samples)
    assert any({"role": "tool", "content": "5"} in s["messages"] for s in samples)


SERVERS = {"serve-rollout": ["-m", "grpo_cli", "serve-rollout", "--engine", "hf"],
           "sglang-contract": ["-m", "grpo_cli.server.sglang_contract_serve"]}


def _start_server(env, cwd, kind: str = "serve-rollout") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *SERVERS[kind], "--model", "builtin:tiny-tools", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", proc.stdout.readline())
        if m:
            return proc, m.group(1)
        assert proc.poll() is None, "server exited early"
    raise AssertionError("server did not start")


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_two_steps_with_tools_colocated(tmp_path, engine):
    overrides = [*SMALL, f"rollout.engine={engine}"]
    if engine == "vllm":
        overrides += ["rollout.vllm.kv_cache_space_gib=1"]
    run_training(build_config("tiny-cpu-tools", overrides=overrides), output_dir=str(tmp_path / "run"))
    _check(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("kind,engine", [("serve-rollout", "hf"), ("sglang-contract", "sglang")])
def test_two_steps_with_tools_against_a_rollout_server(tmp_path, kind, engine):
    """`grpo serve-rollout`, and the SGLang client against the contract server that follows SGLang's own
    routes (`grpo_cli/server/sglang_contract.py`, NOT SGLang: its wheels need CUDA)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server, url = _start_server(env, tmp_path, kind)
    try:
        cfg = build_config("tiny-cpu-tools", overrides=[*SMALL, "rollout.mode=server", f"rollout.engine={engine}",
                                                        f"rollout.server.urls=[{url}]"])
        run_training(cfg, output_dir=str(tmp_path / "run"))
    finally:
        server.kill()
        server.wait(10)
    _check(tmp_path / "run")


@pytest.mark.slow
def test_two_steps_with_tools_in_async_mode(tmp_path):
    """Two Ray actors each run the multi-turn loop on their half of the batch, one step ahead of training; an
    environment is reset in the actor with each prompt's own row (sent with the submission): its `guess` answers
    against that row's `answer_number`, and its `reward()` comes back as the `environment` reward."""
    ray = pytest.importorskip("ray")
    try:
        cfg = build_config("tiny-cpu-tools", overrides=[
            *SMALL, "rollout.mode=async", "rollout.max_staleness=1", "rollout.ray.num_actors=2",
            "rollout.ray.cpus_per_actor=1", "rollout.ray.start_timeout_s=120",
            f"agent.environment={TOOLS}:Counter", f"agent.tool_parser={TOOLS}:always_guess",
            "rewards.functions=[{name: grpo_cli.agent.rewards:environment}]"])
        run_training(cfg, output_dir=str(tmp_path / "run"))
    finally:
        ray.shutdown()
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["tools/calls_per_rollout"] > 0 and r["tools/errors"] == 0 for r in rows), rows
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    checked = 0
    for s in samples:
        target = _answer(s["prompt"])
        said = [m["content"] for m in s["messages"] if m["role"] == "tool"]
        expected = "right" if target == 5 else "higher" if target > 5 else "lower"
        assert set(said) <= {expected}, (target, said)  # empty when the first turn ran out of tokens (no call run)
        assert s["reward"] == len(said)  # the actor's own instance counted its guesses (environment reward)
        checked += bool(said)
    assert checked >= 4, samples


def _answer(prompt: str) -> int:
    """The sum asked by a builtin:arith prompt ("... two plus three ...")."""
    from grpo_cli.data.tasks import NUMBER_WORDS

    words = prompt.split()
    i = words.index("plus")
    return NUMBER_WORDS.index(words[i - 1]) + NUMBER_WORDS.index(words[i + 1])


def test_a_custom_rollout_function_trains_on_its_masks(tmp_path):
    """`rollout.custom` returns ids, masks and logprobs; its environment tokens are in the sequence but not in the
    length metric (sampled tokens only), and a wrong return is named."""
    cfg = build_config("tiny-cpu", overrides=[*SMALL[:6], f"rollout.custom={TOOLS}:sample_then_note"])
    run_training(cfg, output_dir=str(tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["completions/mean_length"] <= cfg.rollout.max_completion_length for r in rows)
    with pytest.raises(ConfigError, match="rollout.custom produces the completions itself"):
        build_config("tiny-cpu-tools", overrides=[f"rollout.custom={TOOLS}:sample_then_note"])
