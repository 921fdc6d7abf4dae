"""Server mode on two GPUs: `grpo serve-rollout --engine vllm` on GPU 1, the trainer on GPU 0, weights pushed over
NCCL (rank 0 ↔ server), three steps of `grpo train`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from gpu_helpers import gpu_env, grpo, needs_two, sets

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")


@needs_two
def test_vllm_server_with_nccl_weight_transport(tmp_path, tiny_checkpoint):
    from grpo_cli.server.launch import wait_ready_line

    server = subprocess.Popen(
        [sys.executable, "-m", "grpo_cli.cli.serve", "--engine", "vllm", "--model", tiny_checkpoint, "--port", "0",
         "--gpu-memory-utilization", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=gpu_env(CUDA_VISIBLE_DEVICES="1", PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    try:
        url = wait_ready_line(server, 600, lines.append)
        assert url, "".join(lines)[-3000:]
        grpo(tmp_path, "train", "--preset", "tiny-cpu-server", "--output-dir", str(tmp_path / "run"),
             *sets(f"model.name_or_path={tiny_checkpoint}", f'rollout.server.urls=["{url}"]',
                   "rollout.server.weight_transport=nccl", "distributed.device=cuda", "train.steps=3"),
             CUDA_VISIBLE_DEVICES="0")
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    finally:
        server.kill()
        server.wait(timeout=30)
