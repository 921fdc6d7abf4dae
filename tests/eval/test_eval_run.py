"""Evaluation during training logs eval/* on schedule, and `grpo eval` on the finished run's checkpoint gives the
same eval/reward/mean as the last in-training evaluation (same seed, same weights, same engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_in_training_eval_and_grpo_eval_agree(tmp_path):
    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache")}
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"please tell words about the {w}"}) + "\n"
                            for w in ("cat", "dog", "sun", "moon", "story", "world", "number", "cat")))
    run = tmp_path / "run"
    train = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "--output-dir", str(run), "--set", "train.steps=4",
         "--set", "eval.every_steps=2", "--set", f"eval.source={data}", "--set", "eval.num_prompts=8"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "eval/reward/mean" in r]
    assert logged == [2, 4]
    assert {"eval/reward/length/mean", "eval/reward/overlong/mean", "eval/pass@1", "eval/pass@4",
            "eval/completions/mean_length"} <= set(rows[-1])
    for target in (run, run / "checkpoint-4"):
        out = subprocess.run([sys.executable, "-m", "grpo_cli", "eval", str(target), "--data", str(data),
                              "--out", str(tmp_path / "eval.json")],
                             capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        report = json.loads((tmp_path / "eval.json").read_text())
        assert report["metrics"]["eval/reward/mean"] == rows[-1]["eval/reward/mean"], (target, report)
        assert report["data"] == str(data) and report["generations_per_prompt"] == 4


def test_grpo_eval_reports_a_bad_target(tmp_path):
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "eval", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "no Hugging Face weights" in out.stderr, out.stderr
