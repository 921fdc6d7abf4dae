"""Data-parallel correctness: a 2-process gloo run (torchrun) on the same replayed global batch and seed ends
with the same parameters as the 1-process run (token_mean counts tokens across ranks; DDP scaling is right)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

WORKER = str(Path(__file__).with_name("dp_worker.py"))


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_two_process_gloo_equals_one_process(tmp_path, tiny_checkpoint, aggregation):
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    # A clean environment for the workers: earlier in-process vLLM tests leave RANK/WORLD_SIZE/MASTER_* set.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    subprocess.run([sys.executable, WORKER, tiny_checkpoint, str(one), aggregation], check=True, timeout=300, env=env)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                    "--master_addr=127.0.0.1", WORKER, tiny_checkpoint, str(two), aggregation],
                   check=True, timeout=180, env=env)
    a, b = load_file(one), load_file(two)
    initial = load_file(Path(tiny_checkpoint) / "model.safetensors")
    moved = max(float((a[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3, "the steps must actually change the weights"
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-5, f"2-process params differ from 1-process by {worst}"
