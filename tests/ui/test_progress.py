"""The live view renders the bar, the trend, the phases, the alarm and a sample; plain lines off a terminal;
everything also lands in train.log."""

from __future__ import annotations

import io

from rich.console import Console

from grpo_cli.ui.live_parts import sparkline
from grpo_cli.ui.progress import ProgressView


def _metrics(step: int) -> dict[str, float]:
    return {"reward/mean": -4.0 + step, "reward/std": 0.5, "loss": 0.01, "kl": 0.002, "tokens_per_second": 900.0,
            "completions/mean_length": 7.0, "time/generate": 0.6, "time/reward": 0.05, "time/train": 0.3,
            "time/sync": 0.0, **({"eval/reward/mean": 0.1 * step} if step % 2 == 0 else {})}


def _sample(step: int) -> list[dict]:
    return [{"step": step, "prompt": "please say words about the cat", "completion": "word " * 200,
             "reward": -1.5, "advantage": 0.3}]


def _text(view: ProgressView) -> str:
    out = Console(file=io.StringIO(), width=140, color_system=None, force_terminal=True)
    out.print(view.render())
    return out.file.getvalue()


def test_rich_view_shows_bar_trend_phases_alarm_and_sample(tmp_path):
    console = Console(file=io.StringIO(), width=140, color_system=None, force_terminal=True)
    with ProgressView(10, mode="rich", console=console, log_path=tmp_path / "train.log") as view:
        for step in range(1, 5):
            view.update(step, _metrics(step), _sample(step))
        view.alarm(4, "most completions hit rollout.max_completion_length")
        text = _text(view)
    assert "4/10" in text and "elapsed 0:00:0" in text and "ETA 0:00:0" in text and "steps/s" in text
    assert "━" in text  # the bar
    assert "reward ▁▃▆█ 0.000" in text, text  # -3, -2, -1, 0: one block per step, min to max
    assert "eval" in text and "▁█ 0.400" in text
    assert "phases" in text and "generate 0.60s" in text and "train 0.30s" in text and "sync" not in text
    assert "alarm  (step 4) most completions hit" in text
    assert "sample (step 4, reward -1.500)" in text and "please say words about the cat" in text
    assert "…" in text and text.count("word") < 80  # 200 words truncated
    log = (tmp_path / "train.log").read_text()
    assert log.count("step ") >= 4 and "step 4/10 reward=0.000" in log and "eval=0.400" in log
    assert "alarm (step 4): most completions" in log


def test_plain_view_prints_one_line_per_step_and_logs_errors(tmp_path):
    console = Console(file=io.StringIO(), width=300, color_system=None)
    try:
        with ProgressView(3, mode="auto", console=console, log_path=tmp_path / "train.log") as view:
            for step in (1, 2):
                view.update(step, _metrics(step), _sample(step))
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    lines = console.file.getvalue().splitlines()
    assert [line.split()[:2] for line in lines] == [["step", "1/3"], ["step", "2/3"]]
    assert "reward=-3.000" in lines[0] and "generate=0.60s" in lines[0]
    log = (tmp_path / "train.log").read_text()
    assert "RuntimeError: boom" in log and "Traceback" in log


def test_sparkline_scales_between_min_and_max():
    assert sparkline([0.0, 1.0, 2.0]) == "▁▅█"
    assert sparkline([1.0, 1.0]) == "▁▁"
    assert sparkline([float("nan"), 1.0, 3.0]) == " ▁█"


def test_fast_steps_show_milliseconds_and_the_done_line_follows_the_last_frame(tmp_path):
    from grpo_cli.ui.live_parts import rate_text

    assert rate_text(20.0) == "20.00 steps/s (50 ms/step)"  # was "(0.0 s/step)"
    assert rate_text(0.21) == "0.21 steps/s (4.8 s/step)"
    console = Console(file=io.StringIO(), width=140, color_system=None, force_terminal=True)
    with ProgressView(2, mode="rich", console=console) as view:
        for step in (1, 2):
            view.update(step, _metrics(step), _sample(step))
        view.finish("done: 2 steps")
    out = console.file.getvalue()
    assert out.rstrip().endswith("done: 2 steps")  # no frame drawn again after it
    assert out.count("done: 2 steps") == 1


def test_fast_phases_show_milliseconds_not_zero(tmp_path):
    """At 20 steps/s the phases take a few ms each: the bar and the plain line said `reward 0.00s` (was: two
    decimals of seconds); now milliseconds, and `0s` only for a phase that took no time."""
    from grpo_cli.ui.live_parts import duration

    assert [duration(t) for t in (0.0, 0.0003, 0.0042, 0.0304, 0.6, 2.555)] == ["0s", "0.3ms", "4.2ms", "30ms",
                                                                                "0.60s", "2.56s"]
    fast = {**_metrics(1), "time/generate": 0.012, "time/reward": 0.0004, "time/train": 0.031, "time/sync": 0.0}
    console = Console(file=io.StringIO(), width=300, color_system=None)
    with ProgressView(3, mode="plain", console=console) as view:
        view.update(1, fast)
        text = _text(view)
    line = console.file.getvalue()
    assert "generate=12ms reward=0.4ms" in line and "train=31ms sync=0s" in line and "0.00s" not in line
    assert "generate 12ms  reward 0.4ms" in text and "train 31ms" in text and "0.00s" not in text


def test_stream_mode_shows_pool_buffer_and_lag(tmp_path):
    """Stream mode's metrics (docs/streaming.md) in both views; other modes' lines carry none of them."""
    stream = {"stream/in_flight": 5.0, "stream/buffer_depth": 3.0, "stream/version_lag_mean": 0.25,
              "stream/version_lag_max": 1.0, "stream/mixed_version_rows": 4.0, "stream/dropped_groups": 1.0,
              "stream/engine_idle_frac": 0.07}
    console = Console(file=io.StringIO(), width=300, color_system=None, force_terminal=True)
    with ProgressView(3, mode="rich", console=console, log_path=tmp_path / "train.log") as view:
        view.update(1, {**_metrics(1), **stream}, [])
        text = _text(view)
    expect = "pool=5 buf=3 lag=0.25/1 mixed=4 dropped=1 idle=7%"
    assert expect in text and expect in (tmp_path / "train.log").read_text()
    console = Console(file=io.StringIO(), width=300, color_system=None)
    with ProgressView(3, mode="plain", console=console, log_path=tmp_path / "plain.log") as view:
        view.update(1, _metrics(1), [])
    assert "pool=" not in console.file.getvalue()
