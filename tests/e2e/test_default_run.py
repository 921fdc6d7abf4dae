"""The default preset really learns on CPU: the README's first command, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_grpo_train_default_learns(tmp_path):
    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mean reward first 10% =" in out.stdout
    assert "alarm" not in out.stdout  # the quick start runs clean (a one-step truncation blip is not an alarm)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reward_last_10pct"] > summary["reward_first_10pct"] + 2.0, summary
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == summary["steps"]
    assert {"reward/mean", "loss", "time/generate", "time/train", "tokens_per_second"} <= set(rows[0])
    assert (tmp_path / "run" / "config.yaml").read_text().startswith("preset: tiny-cpu")
    assert (tmp_path / "run" / "completions.jsonl").stat().st_size > 0
