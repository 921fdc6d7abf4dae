"""Several processes on CPU through the CLI: `grpo train --set distributed.num_processes=2` relaunches itself
through `accelerate launch` (gloo workers), and `accelerate launch -m grpo_cli train ...` typed by hand runs as
workers without launching again. Rank 0 alone writes the run directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_env import clean_env, free_port


def _env(tmp_path) -> dict:
    return clean_env(GRPO_CLI_CACHE=str(tmp_path / "cache"))


def _check_run(run, out) -> None:
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]  # one writer: no line per rank
    assert out.stdout.count("done: 3 steps") == 1


@pytest.mark.slow
def test_cli_relaunches_through_accelerate(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu", "--output-dir", str(run), "--set",
         "distributed.num_processes=2", "--set", "train.steps=3", "--set", f"distributed.main_process_port={free_port()}",
         "--set", "logging.progress=plain"],
        capture_output=True, text=True, timeout=600, env=_env(tmp_path), cwd=tmp_path,
    )
    assert "launching: " in out.stdout and "--multi_gpu" in out.stdout
    assert "were not passed to `accelerate launch`" not in out.stdout + out.stderr  # grpo passes what it knows
    _check_run(run, out)


@pytest.mark.slow
def test_accelerate_launch_by_hand(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu",
         "--main_process_port", str(free_port()), "-m", "grpo_cli", "train", "--preset", "tiny-cpu",
         "--output-dir", str(run), "--set", "train.steps=3", "--set", "logging.progress=plain"],
        capture_output=True, text=True, timeout=600, env=_env(tmp_path), cwd=tmp_path,
    )
    assert "launching: " not in out.stdout
    _check_run(run, out)
