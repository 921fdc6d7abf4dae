"""Helpers of the GPU suite: device counts, a clean environment for GPU subprocesses, `grpo` runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_env import DIST_VARS, free_port


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif(gpus() < 2, reason="needs two GPUs")


def gpu_env(**extra: str) -> dict[str, str]:
    """os.environ minus the process-group variables (and minus DS_ACCELERATOR=cpu that CPU tests set)."""
    env = {k: v for k, v in os.environ.items() if k not in (*DIST_VARS, "DS_ACCELERATOR")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", **extra)
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
