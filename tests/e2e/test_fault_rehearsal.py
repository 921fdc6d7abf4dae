"""`GRPO_INJECT_FAULT` through the command line, as a user rehearses a failure: a NaN loss on one rank of a 2-process
run is skipped by both ranks and counted; a rank that SIGKILLs itself leaves a checkpoint the next run resumes from;
a rollout server that stops answering makes the trainer stop with a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = [sys.executable, "-m", "grpo_cli", "train"]


def _env(tmp_path: Path, fault: str) -> dict:
    return {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
            "GRPO_INJECT_FAULT": fault}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_nonfinite_loss_on_one_rank_is_skipped_by_both(tmp_path):
    """The acceptance command of issue 46; before ranks agreed on finiteness, rank 0 waited in DDP's gradient
    all-reduce for rank 1, which had skipped its backward (here: until the 1-minute process-group timeout)."""
    run = tmp_path / "run"
    out = subprocess.run([*TRAIN, "--nproc", "2", "--set", "train.steps=4", "--set", "distributed.timeout_minutes=1",
                          "--output-dir", str(run)], env=_env(tmp_path, "nonfinite_loss:rank=1:step=2"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["train/skipped_steps"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert "loss" not in rows[1] and "loss" in rows[2]
    log = (run / "train.log").read_text()
    assert log.count("FAULT INJECTION") == 1 and "the loss of rank 1 at step 2 is NaN" in log


# extended (CI time); the default run covers its paths: tests/cli/test_inject_fault.py's kill test (the SIGKILL at its
# step) and tests/e2e/test_resume.py's SIGKILL cases (the resume)
@pytest.mark.slow
@pytest.mark.extended
def test_kill_at_a_step_then_resume(tmp_path):
    run = tmp_path / "run"
    args = [*TRAIN, "--set", "train.steps=3", "--set", "checkpoint.every_steps=1", "--set", "eval.every_steps=0",
            "--output-dir", str(run)]
    killed = subprocess.run(args, env=_env(tmp_path, "kill:step=3"), cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert (run / "checkpoint-2" / "MANIFEST.json").exists() and not (run / "checkpoint-3").exists()
    resumed = subprocess.run([*args, "--set", "checkpoint.resume=auto"], env=_env(tmp_path, ""), cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and [r["step"] for r in _rows(run)][-1] == 3


# extended (CI time); the default run covers its paths: tests/server/test_server_hang_fault.py (the hang, the
# client's timeout) and tests/e2e/test_server_death.py (the trainer stopping with a checkpoint)
@pytest.mark.slow
@pytest.mark.extended
def test_server_hang_stops_the_trainer_with_a_checkpoint(tmp_path):
    from test_server_death import _start_server

    server, url = _start_server(_env(tmp_path, "server_hang:step=3"), tmp_path)
    run = tmp_path / "run"
    try:
        out = subprocess.run([*TRAIN, "--preset", "tiny-cpu-server", "--output-dir", str(run), "--set",
                              f'rollout.server.urls=["{url}"]', "--set", "train.steps=5", "--set",
                              "rollout.server.request_timeout_s=5", "--set", "rollout.server.retries=0"],
                             env=_env(tmp_path, ""), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        server.kill()
    assert out.returncode == 2, out.stdout + out.stderr
    assert "stopped answering during /generate" in out.stdout + out.stderr
    assert (run / "checkpoint-2" / "MANIFEST.json").exists() and [r["step"] for r in _rows(run)] == [1, 2]
