"""For tests that start torchrun/accelerate/grpo subprocesses: a free loopback port and an environment without the
process-group variables that in-process vLLM tests leave behind (RANK, WORLD_SIZE, MASTER_*)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ minus the process-group variables, gloo on loopback, DeepSpeed told it is on CPU, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(GLOO_SOCKET_IFNAME="lo", DS_ACCELERATOR="cpu", **extra)
    return env


def run_two_ranks(worker: str, args: list[str], out: Path, *, timeout: float) -> list[dict]:
    """Start `worker ARGS OUT` as ranks 0 and 1 of a gloo group on loopback (one thread each), wait for both, fail
    with their output tails if either fails; returns each rank's `OUT/rank{r}.json`."""
    return run_ranks(worker, args, out, timeout=timeout, world=2)


def run_ranks(worker: str, args: list[str], out: Path, *, timeout: float, world: int) -> list[dict]:
    """`run_two_ranks` for `world` ranks (e.g. 4 for HSDP's 2 x 2 mesh)."""
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, worker, *args, str(out)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
