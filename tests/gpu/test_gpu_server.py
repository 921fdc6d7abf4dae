"""Server mode on a GPU. One GPU, torch alone: `grpo serve-rollout --engine hf` and `grpo train` share the device, the
trainer in bf16 (float32 masters) against the server's float32, weights over HTTP and over /dev/shm, every sync
verified. Two GPUs and vLLM: `grpo serve-rollout --engine vllm` on GPU 1, the trainer on GPU 0, weights over NCCL."""

from __future__ import annotations

import subprocess
import sys

import pytest
from gpu_helpers import DEVICE, gpu_env, grpo, hf_server, needs_two, needs_vllm, sets, step_metrics, summary


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_hf_server_on_the_same_gpu(tmp_path, transport):
    run = tmp_path / "run"
    with hf_server(tmp_path) as url:
        grpo(tmp_path, "train", "--preset", "tiny-cpu-server", "--output-dir", str(run),
             *sets(f'rollout.server.urls=["{url}"]', f"rollout.server.weight_transport={transport}",
                   f"distributed.device={DEVICE}", "model.dtype=bfloat16", "train.steps=4", "eval.every_steps=0"))
    assert summary(run)["steps"] == 4
    synced = [r for r in step_metrics(run) if "sync/max_probe_diff" in r]
    assert len(synced) >= 3 and all(r["sync/max_probe_diff"] < 6e-2 for r in synced)


@needs_two
@needs_vllm
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
        assert summary(tmp_path / "run")["steps"] == 3
    finally:
        server.kill()
        server.wait(timeout=30)
