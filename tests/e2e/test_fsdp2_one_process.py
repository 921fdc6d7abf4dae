"""`grpo train --set distributed.backend=fsdp2` in one process, without a launcher: the backend makes its own 1-rank
group (issue 36: `fully_shard`'s default mesh raised "environment variable RANK expected, but not set") and the run
ends with it destroyed. fsdp2 shards the policy, so the hf engine cannot share it in colocate mode (a config rule);
one process runs with a rollout server (here `grpo serve-rollout --engine hf`, the weights pushed over HTTP every
step), or with colocated vLLM. With `fsdp2.cpu_offload`, which is how a model larger than one GPU's memory trains on
one GPU. A fast in-process check is tests/launch/test_own_group.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_env import clean_env

STEPS = ["train.steps=2", "train.prompts_per_step=2", "train.generations_per_prompt=2", "train.micro_batch_size=2",
         "eval.every_steps=0", "rollout.max_completion_length=6", "distributed.backend=fsdp2"]


def _train(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [arg for o in (*STEPS, *overrides) for arg in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu", "--output-dir",
                           str(tmp_path / "run"), *sets], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=clean_env(PYTHONUNBUFFERED="1", GRPO_CLI_CACHE=str(tmp_path / "cache")))


def _check(tmp_path, out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "Traceback" not in out.stdout + out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["backend"] == "fsdp2" and summary["world_size"] == 1, summary
    assert (tmp_path / "run" / "final-model" / "model.safetensors").is_file()
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~40 s: a server and a trainer start
def test_fsdp2_with_cpu_offload_against_a_rollout_server(tmp_path):
    from grpo_cli.server.launch import wait_ready_line

    server = subprocess.Popen([sys.executable, "-m", "grpo_cli", "serve-rollout", "--engine", "hf", "--model",
                               "builtin:tiny", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=tmp_path, env=clean_env(PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    try:
        url = wait_ready_line(server, 120, lines.append)
        assert url is not None, "".join(lines)[-3000:]
        out = _train(tmp_path, "rollout.mode=server", f'rollout.server.urls=["{url}"]',
                     "distributed.fsdp2.cpu_offload=true")
    finally:
        server.kill()
        server.wait(10)
    rows = _check(tmp_path, out)
    assert all(r["sync/tensors"] > 0 for r in rows), rows  # the sharded weights reached the server every step


@pytest.mark.slow  # ~60 s: vLLM starts
@pytest.mark.vllm
def test_fsdp2_with_colocated_vllm(tmp_path):
    pytest.importorskip("vllm")
    _check(tmp_path, _train(tmp_path, "rollout.engine=vllm", "rollout.vllm.kv_cache_space_gib=1"))
