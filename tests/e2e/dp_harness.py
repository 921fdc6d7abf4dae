"""Run tests/e2e/dp_worker.py on 1 or 2 gloo processes and read back the parameters rank 0 saved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dist_env import clean_env, free_port
from safetensors.torch import load_file

WORKER = str(Path(__file__).with_name("dp_worker.py"))
SHARDED = ["distributed.backend=fsdp2", "rollout.engine=vllm"]  # hf colocate cannot share sharded weights


def run_worker(ckpt: str, out: Path, aggregation: str, *overrides: str, procs: int) -> dict:
    """Run dp_worker.py on `procs` processes; returns the consolidated parameters rank 0 saved."""
    if procs == 1:
        cmd = [sys.executable, WORKER]
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={port}",
               "--master_addr=127.0.0.1", WORKER]
    subprocess.run([*cmd, ckpt, str(out), aggregation, *overrides], check=True, timeout=300,
                   env=clean_env(MASTER_ADDR="127.0.0.1"))
    return load_file(out)
