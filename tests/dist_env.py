"""For tests that start torchrun/accelerate/grpo subprocesses: a free loopback port and an environment without the
process-group variables that in-process vLLM tests leave behind (RANK, WORLD_SIZE, MASTER_*)."""

from __future__ import annotations

import os
import socket

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
