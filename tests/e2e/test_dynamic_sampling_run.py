"""DAPO dynamic sampling on a real run: the tiny model learns a 0/1 reward while groups of identical rewards are
dropped and redrawn (counted in metrics.jsonl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CONFIG = r"""
rewards:
  functions:
    - name: format
      kwargs: {pattern: '\S+(\s+\S+){2,4}'}
train:
  steps: 40
  dynamic_sampling: {enabled: true, max_extra_rounds: 3}
"""


@pytest.mark.slow
def test_dynamic_sampling_run_learns_and_counts_redraws(tmp_path):
    (tmp_path / "ds.yaml").write_text(CONFIG)
    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "-c", str(tmp_path / "ds.yaml"), "--output-dir",
         str(tmp_path / "run")],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step 1/40" in out.stdout and " dropped=" in out.stdout and " redrawn=" in out.stdout, out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # A 3-5 word completion: ~3% of random ones at the start (seen 0.08 -> 0.55 over 40 steps).
    assert summary["reward_last_10pct"] > summary["reward_first_10pct"] + 0.2, summary
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["dynamic_sampling/extra_rounds"] <= 3 for r in rows)
    dropped = sum(r["dynamic_sampling/dropped_groups"] for r in rows)
    drawn = sum(r["dynamic_sampling/drawn_prompts"] for r in rows)
    assert dropped > 0 and drawn >= 8, (dropped, drawn)
    assert rows[0]["dynamic_sampling/drawn_prompts"] == 8 * rows[0]["dynamic_sampling/extra_rounds"]
    assert "entropy" in rows[0] and 0 < rows[0]["entropy"] < 10
