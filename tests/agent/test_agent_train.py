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
        prompts, batch = _generate_outside_the_pipeline(cfg)
    finally:
        ray.shutdown()
    _check_one_loop(cfg, prompts, batch)
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


def _generate_outside_the_pipeline(cfg):
    """What an evaluation or a dynamic-sampling round generates in async mode: the trainer's own `generate`, not a
    pipeline submission."""
    import torch

    from grpo_cli.runtime.dist import DistInfo
    from grpo_cli.train.loop import generate_phase
    from grpo_cli.train.pipeline import take_step_prompts
    from grpo_cli.train.run import build_trainer

    tr = build_trainer(cfg, DistInfo(), torch.device("cpu"), log=lambda *_: None)
    try:
        tr.sync(0)
        prompts = take_step_prompts(tr.cursor, prompts_per_step=4, rank=0, world_size=1)
        return prompts, generate_phase(tr, prompts, seed=7)
    finally:
        tr.engine.close()


def _check_one_loop(cfg, prompts, batch) -> None:
    """One multi-turn loop ran, in the actors, with each prompt's row: every trained (mask 1) token was sampled
    (logprob < 0), every environment token has mask 0 and logprob 0, and each tool answer is right for its own row.
    A second loop around the actors' would train on their tool tokens (mask 1, logprob 0)."""
    n = cfg.train.generations_per_prompt
    assert len(batch.completion_ids) == len(prompts) * n and batch.loss_masks is not None
    calls = 0
    for j, (mask, lps) in enumerate(zip(batch.loss_masks, batch.sampler_logprobs, strict=True)):
        assert all((lp < 0) if m else (lp == 0.0) for m, lp in zip(mask, lps, strict=True)), (j, mask, lps)
        target = prompts[j // n].columns["answer_number"]
        said = [m["content"] for m in batch.trajectories[j] if m["role"] == "tool"]
        assert set(said) <= {"right" if target == 5 else "higher" if target > 5 else "lower"}, (target, said)
        assert batch.environment_rewards[j] == len(said) and (0 in mask or not said), (j, said, mask)
        calls += len(said)
    assert calls >= 1, batch.trajectories  # most trajectories spend their 64 tokens before a turn ends


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


@pytest.mark.slow
def test_a_custom_rollout_function_runs_in_the_async_actors():
    """In async mode the Ray actor calls `rollout.custom` with its own engine (the pipeline's submissions and the
    trainer's own `generate` both end in the actor's `generate`): every completion ends with the function's two
    environment tokens, at mask 0 and logprob 0, once."""
    ray = pytest.importorskip("ray")
    try:
        cfg = build_config("tiny-cpu", overrides=[
            *SMALL[:6], f"rollout.custom={TOOLS}:sample_then_note", "rollout.mode=async", "rollout.max_staleness=1",
            "rollout.ray.num_actors=1", "rollout.ray.cpus_per_actor=1", "rollout.ray.start_timeout_s=120"])
        prompts, batch = _generate_outside_the_pipeline(cfg)
    finally:
        ray.shutdown()
    assert len(batch.completion_ids) == len(prompts) * cfg.train.generations_per_prompt
    for ids, mask, lps in zip(batch.completion_ids, batch.loss_masks, batch.sampler_logprobs, strict=True):
        assert mask[-2:] == [0, 0] and lps[-2:] == [0.0, 0.0] and 0 not in mask[:-2], (ids, mask)
