"""Run tests/e2e/dp_worker.py on 1 or 2 gloo processes and read back the parameters rank 0 saved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dist_env import clean_env, free_port
from safetensors.torch import load_file

WORKER = str(Path(__file__).with_name("dp_worker.py"))
SHARDED = ["distributed.backend=fsdp2", "rollout.engine=vllm"]  # hf colocate cannot share sharded weights
ZERO2 = ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=2"]
ZERO3 = ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm"]
ZERO3_OFFLOAD = [*ZERO3, "distributed.deepspeed.offload_optimizer=true"]


def run_worker(ckpt: str, out: Path, aggregation: str, *overrides: str, procs: int, **env: str) -> dict:
    """Run dp_worker.py on `procs` processes (extra environment `env`, e.g. DP_WORKER_STEPS); returns the
    consolidated parameters rank 0 saved."""
    if procs == 1:
        cmd = [sys.executable, WORKER]
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={port}",
               "--master_addr=127.0.0.1", WORKER]
    # timeout: the first DeepSpeed run JIT-builds its shared-memory allreduce op (minutes on a loaded machine)
    subprocess.run([*cmd, ckpt, str(out), aggregation, *overrides], check=True, timeout=600,
                   env=clean_env(MASTER_ADDR="127.0.0.1", **env))
    return load_file(out)
