"""`grpo report`: a real tiny `grpo train` run → valid PNGs and a summary; synthetic runs for the edge cases
(still running, resumed steps, nulls, absent metrics, bad input)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    from matplotlib.image import imread

    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100, (path, pixels.shape)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A real 4-step tiny-cpu run with a KL term (β > 0), built once for the module (~5 s)."""
    root = tmp_path_factory.mktemp("report-run")
    env = {**os.environ, "GRPO_CLI_CACHE": os.environ.get("GRPO_CLI_CACHE", str(root / "cache"))}
    cmd = [sys.executable, "-m", "grpo_cli", "train", "--output-dir", str(root / "run"), "--set", "train.steps=4",
           "--set", "train.prompts_per_step=2", "--set", "train.micro_batch_size=16", "--set", "algorithm.kl.beta=0.05"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
    return root / "run"


def test_report_on_real_run_writes_valid_pngs(tiny_run, tmp_path):
    result = runner.invoke(app, ["report", str(tiny_run), "--out-dir", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    for name in ("reward.png", "kl.png", "loss.png", "mismatch.png", "phases.png"):
        _assert_png(tmp_path / "plots" / name)
        assert f"wrote {tmp_path / 'plots' / name}" in result.output
    assert "reward mean" in result.output and "time per phase" in result.output and "generate" in result.output
    assert "finished" in result.output and "step 4/4" in result.output


def test_report_json_on_real_run(tiny_run, tmp_path):
    result = runner.invoke(app, ["report", str(tiny_run), "--json", "--no-plots"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["steps_logged"] == 4 and info["total_steps"] == 4 and info["status"] == "finished"
    assert info["plots"] == [] and info["preset"] == "tiny-cpu"
    assert {"reward/mean", "loss", "kl", "rollout_correction/k3_kl"} <= set(info["metrics"])
    assert {"generate", "train"} <= set(info["phases"])
    shares = sum(p["share"] for p in info["phases"].values())
    assert shares == pytest.approx(1.0)


def _row(step: int, **extra) -> dict:
    return {"step": step, "time": 1000.0 + step, "reward/mean": 0.1 * step, "reward/std": 0.5, "loss": 1.0 / step,
            "time/generate": 0.2, "time/train": 0.1, "time/step": 0.35, **extra}


def _write_run(path: Path, rows: list, *, tail: str = "", summary: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("preset: custom\ntrain:\n  steps: 10\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if summary:
        (path / "summary.json").write_text(json.dumps({"steps": len(rows), "interrupted": True}))
    return path


def test_report_on_running_resumed_run(tmp_path):
    """No summary yet, a half-written last line, a step logged twice (resume), nulls; no kl/mismatch metrics."""
    rows = [_row(1), _row(2), _row(3, loss=None), _row(2, **{"reward/mean": 9.0}), _row(4)]
    run = _write_run(tmp_path / "run", rows, tail='{"step": 5, "reward/me')
    result = runner.invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["status"].startswith("running") and info["steps_logged"] == 4 and info["last_step"] == 4
    assert info["unreadable_lines"] == 1
    assert info["metrics"]["reward/mean"]["max"] == 9.0  # the resumed step 2 replaced the first one
    assert info["metrics"]["loss"]["last"] == pytest.approx(0.25)
    assert set(info["skipped_plots"]) == {"kl.png", "mismatch.png"}
    for path in info["plots"]:
        _assert_png(Path(path))
    assert {Path(p).name for p in info["plots"]} == {"reward.png", "loss.png", "phases.png"}
    text = runner.invoke(app, ["report", str(run), "--no-plots"]).output
    assert "step 4/10" in text and "unreadable line" in text


def test_report_long_run_smooths_and_reports_interrupted(tmp_path):
    rows = [_row(i, **{"rollout_correction/k3_kl": 1e-4 * i, "reward/a/mean": 0.1, "reward/b/mean": 0.2})
            for i in range(1, 151)]
    run = _write_run(tmp_path / "run", rows, summary=True)
    result = runner.invoke(app, ["report", str(run), "--smooth", "0"])
    assert result.exit_code == 0, result.output
    assert "interrupted" in result.output and "reward/a/mean" in result.output
    _assert_png(run / "report" / "mismatch.png")
    _assert_png(run / "report" / "reward.png")


@pytest.mark.parametrize("setup,needle,code", [
    (lambda p: None, "no such run directory", 2),
    (lambda p: p.mkdir(), "has no metrics.jsonl", 2),
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text("")), "no steps logged yet", 0),
])
def test_report_bad_or_empty_run_dir(tmp_path, setup, needle, code):
    target = tmp_path / "run"
    setup(target)
    result = runner.invoke(app, ["report", str(target)])
    assert result.exit_code == code, result.output
    assert needle in result.output and "Traceback" not in result.output


def test_report_plots_eval_beside_train_reward(tmp_path, monkeypatch):
    """eval/reward/mean is logged every few steps: the reward plot draws those points beside the train reward and
    the summary reports its last value."""
    rows = [_row(i, **({"eval/reward/mean": -1.0 + 0.1 * i} if i % 5 == 0 else {})) for i in range(1, 21)]
    run = _write_run(tmp_path / "run", rows)
    drawn = []
    from grpo_cli.ui import report as report_module

    real_plot = report_module._plot_reward

    def spy(run_, window):
        fig = real_plot(run_, window)
        drawn.extend(line.get_label() for ax in fig.axes for line in ax.get_lines())
        return fig

    monkeypatch.setattr(report_module, "_plot_reward", spy)
    result = runner.invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["metrics"]["eval/reward/mean"]["last"] == pytest.approx(1.0)
    assert "eval reward (held-out)" in drawn and "reward mean" in drawn
    _assert_png(run / "report" / "reward.png")
