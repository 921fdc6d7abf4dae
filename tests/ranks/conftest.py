"""The rank-divergence suite's fixtures: a `grpo serve-rollout` teacher whose max_model_len is below some rows (so it
refuses one rank's /score request), started once for the module that asks for it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TEACHER_MAX_LEN = 8
"""The served teacher's max_model_len: above rank 0's rows (4 + 2 tokens), below rank 1's (4 + 10) in once_cases."""


@pytest.fixture(scope="module")
def short_teacher(tiny_checkpoint):
    """URL of `python -m grpo_cli.cli.serve --engine hf --model TINY --max-model-len 8` (killed afterwards)."""
    from grpo_cli.server.launch import wait_ready_line

    cmd = [sys.executable, "-m", "grpo_cli.cli.serve", "--engine", "hf", "--model", tiny_checkpoint, "--port", "0",
           "--max-model-len", str(TEACHER_MAX_LEN)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    try:
        url = wait_ready_line(proc, 120.0, lines.append)
        assert url is not None, "teacher server did not start:\n" + "".join(lines)[-3000:]
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)
