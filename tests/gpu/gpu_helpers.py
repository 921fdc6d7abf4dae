"""Helpers of the GPU suite: device counts, the vLLM condition (only the tests that need vLLM carry it), a clean
environment for GPU subprocesses, `grpo` runs, a `grpo serve-rollout --engine hf` server on the same GPU, and the
files a run leaves (metrics, summary)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_env import DIST_VARS, free_port


ON_CPU = os.environ.get("GRPO_GPU_SUITE_ON_CPU") == "1"
"""Run the suite's logic on the CPU (`GRPO_GPU_SUITE_ON_CPU=1`): how it is checked on a machine without a GPU
before a GPU is paid for; the CUDA-only figures (memory metrics, `memory_allocated`) are then not asserted."""
DEVICE = "cpu" if ON_CPU else "cuda"


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif(gpus() < 2, reason="needs two GPUs")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
"""The only vLLM condition of the suite: a CUDA machine with torch alone runs every other test."""


def gpu_env(**extra: str) -> dict[str, str]:
    """os.environ minus the process-group variables (and minus DS_ACCELERATOR=cpu that CPU tests set)."""
    env = {k: v for k, v in os.environ.items() if k not in (*DIST_VARS, "DS_ACCELERATOR")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1", **extra)
    return env


def grpo(tmp_path: Path, *args: str, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    """`python -m grpo_cli ARGS` in `tmp_path`; asserts exit 0 and returns the process."""
    proc = subprocess.run([sys.executable, "-m", "grpo_cli", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, env=gpu_env(GRPO_CLI_CACHE=str(tmp_path / "cache"), **env))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def sets(*overrides: str) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def torchrun(procs: int, *cmd: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={free_port()}",
            "--master_addr=127.0.0.1", *cmd]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def step_metrics(run: Path) -> list[dict]:
    """The per-step records of `RUN/metrics.jsonl` (those with a `step`)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r]


@contextlib.contextmanager
def hf_server(tmp_path: Path, model: str = "builtin:tiny", *args: str):
    """`grpo serve-rollout --engine hf` on this machine's GPU (its `auto` device), yielding its URL; killed after.
    It shares `tmp_path/cache` with the `grpo` runs, so `builtin:tiny` is the same checkpoint on both sides."""
    from grpo_cli.server.launch import wait_ready_line

    server = subprocess.Popen(
        [sys.executable, "-m", "grpo_cli", "serve-rollout", "--engine", "hf", "--model", model, "--port", "0", *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=gpu_env(GRPO_CLI_CACHE=str(tmp_path / "cache")))
    lines: list[str] = []
    try:
        url = wait_ready_line(server, 600, lines.append)
        assert url, "".join(lines)[-3000:]
        yield url
    finally:
        server.kill()
        server.wait(timeout=30)
