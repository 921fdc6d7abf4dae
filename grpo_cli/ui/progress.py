"""Live training view (rich) on a terminal, one plain line per step otherwise; every line also goes to `train.log`
in the run directory, so a run under nohup/tmux/screen keeps its log when the terminal goes away."""

from __future__ import annotations

import time
import traceback
from collections import deque
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from grpo_cli.ui.live_parts import (duration, fmt, memory_line, memory_plain, phase_bar, progress_line, sample_panel,
                                    trend_line)
from grpo_cli.ui.terminal import TerminalStream, stdout_stream

EVAL_KEY = "eval/reward/mean"


def _phase_text(metrics: dict[str, float]) -> str:
    return " ".join(f"{p}={duration(metrics.get(f'time/{p}', 0.0))}"
                    for p in ("generate", "reward", "logprobs", "train", "sync"))


def _async_text(metrics: dict[str, float]) -> str:
    """Async mode: staleness of the batch and the actor's generation time (hidden behind training)."""
    if "async/in_flight" not in metrics:
        return ""
    return f" stale={fmt(metrics.get('staleness'), '.0f')} actor_gen={fmt(metrics.get('async/actor_generate_s'), '.2f')}s"


def _stream_text(metrics: dict[str, float]) -> str:
    """Stream mode: the pool (groups generating), the buffer (finished, waiting), the per-token version lag (mean and
    max of this step's tokens), rows spanning versions, groups dropped and the engines' idle fraction."""
    if "stream/in_flight" not in metrics:
        return ""
    return (f" pool={fmt(metrics.get('stream/in_flight'), '.0f')} buf={fmt(metrics.get('stream/buffer_depth'), '.0f')}"
            f" lag={fmt(metrics.get('stream/version_lag_mean'), '.2f')}/{fmt(metrics.get('stream/version_lag_max'), '.0f')}"
            f" mixed={fmt(metrics.get('stream/mixed_version_rows'), '.0f')}"
            f" dropped={fmt(metrics.get('stream/dropped_groups'), '.0f')}"
            f" idle={fmt(100 * metrics.get('stream/engine_idle_frac', float('nan')), '.0f')}%")


def _sampling_text(metrics: dict[str, float]) -> str:
    """Dynamic sampling: groups dropped (identical rewards) and prompts drawn in extra rounds this step."""
    if "dynamic_sampling/dropped_groups" not in metrics:
        return ""
    return (f" dropped={fmt(metrics['dynamic_sampling/dropped_groups'], '.0f')}"
            f" redrawn={fmt(metrics.get('dynamic_sampling/drawn_prompts'), '.0f')}")


def plain_line(step: int, total: int, metrics: dict[str, float], eta: float | None) -> str:
    m = metrics
    evals = f" eval={fmt(m[EVAL_KEY])}" if EVAL_KEY in m else ""
    return (f"step {step}/{total} reward={fmt(m.get('reward/mean'))} std={fmt(m.get('reward/std'))}{evals} "
            f"loss={fmt(m.get('loss'), '.4f')} kl={fmt(m.get('kl'), '.4f')} "
            f"tok/s={fmt(m.get('tokens_per_second'), '.0f')} {_phase_text(m)}{_async_text(m)}{_stream_text(m)}{_sampling_text(m)}"
            f"{memory_plain(m)} eta={fmt(eta, '.0f')}s")


class ProgressView:
    """`update(step, metrics, samples)` renders a live view (mode rich) or plain lines (plain, or auto off a tty);
    `message`/`alarm` print above it. With `log_path`, plain lines and messages are appended there too."""

    def __init__(self, total_steps: int, *, mode: str = "auto", console: Console | None = None,
                 log_path: Path | None = None, history: int = 40) -> None:
        self.stream: TerminalStream | None = None
        if console is None:
            self.stream = stdout_stream()
            console = Console(file=self.stream)
        self.console = console
        self.total = total_steps
        tty = self.stream.isatty() if self.stream is not None else console.is_terminal
        self.rich = mode == "rich" or (mode == "auto" and tty)
        self.created = self.start = time.perf_counter()
        self.first_step: int | None = None
        self.step, self.metrics, self.sample = 0, {}, None
        self.rewards: deque[float] = deque(maxlen=history)
        self.evals: deque[float] = deque(maxlen=history)
        self.last_alarm: str | None = None
        self.live: Live | None = None
        self.log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log = open(log_path, "a", buffering=1)

    def __enter__(self) -> ProgressView:
        if self.rich:
            self.live = Live(console=self.console, refresh_per_second=2, transient=False, get_renderable=self.render,
                             redirect_stderr=False)
            self.live.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.live is not None:
            self.live.__exit__(exc_type, exc, tb)
        if self.log is not None:
            if exc_type is not None and not issubclass(exc_type, SystemExit):
                self._write_log("".join(traceback.format_exception(exc_type, exc, tb)).rstrip())
            self.log.close()

    def _write_log(self, text: str) -> None:
        if self.log is not None:
            self.log.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")

    def _rate(self, step: int) -> float | None:
        """Steps per second since the first reported step (so model loading does not count)."""
        if self.first_step is None or step <= self.first_step:
            return None
        return (step - self.first_step) / (time.perf_counter() - self.start)

    def _eta(self, step: int) -> float | None:
        rate = self._rate(step)
        return None if not rate else (self.total - step) / rate

    def render(self) -> Group:
        """The whole live view for the latest step."""
        m, step = self.metrics, self.step
        parts = [progress_line(step, self.total, elapsed=time.perf_counter() - self.created, eta=self._eta(step),
                               steps_per_s=self._rate(step)),
                 trend_line("reward", list(self.rewards), style="green")]
        if self.evals:
            parts.append(trend_line("eval", list(self.evals), style="magenta"))
        parts.append(Text(f"{'':7}loss {fmt(m.get('loss'), '.4f')}  kl {fmt(m.get('kl'), '.4f')}  "
                          f"entropy {fmt(m.get('entropy'), '.3f')}  k3_kl {fmt(m.get('rollout_correction/k3_kl'), '.2e')}  "
                          f"length {fmt(m.get('completions/mean_length'), '.1f')}  "
                          f"tok/s {fmt(m.get('tokens_per_second'), '.0f')}{_async_text(m)}{_stream_text(m)}{_sampling_text(m)}"))
        parts.append(phase_bar(m))
        if (memory := memory_line(m)) is not None:
            parts.append(memory)
        alarm = Text("alarm  ", style="bold")
        parts.append(alarm.append(self.last_alarm, style="bold red") if self.last_alarm
                     else alarm.append("none", style="dim"))
        parts.append(sample_panel(self.sample, step=step))
        return Group(*parts)

    def update(self, step: int, metrics: dict[str, float], samples: list[dict] | None = None) -> None:
        if self.first_step is None:
            self.first_step, self.start = step, time.perf_counter()
        self.step, self.metrics = step, metrics
        self.rewards.append(metrics.get("reward/mean", float("nan")))
        if EVAL_KEY in metrics:
            self.evals.append(metrics[EVAL_KEY])
        if samples:
            self.sample = samples[0]
        line = plain_line(step, self.total, metrics, self._eta(step))
        self._write_log(line)
        if self.live is not None:
            self.live.refresh()
        else:
            self.console.print(line, highlight=False, soft_wrap=True)

    def finish(self, text: str) -> None:
        """The run's last line, below the final frame: the live view is stopped first (its last frame stays on
        screen once), so the line is not printed above a frame that is then drawn again."""
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self.live = None
        self.message(text)

    def alarm(self, step: int, text: str) -> None:
        self.last_alarm = f"(step {step}) {text}"
        self.message(f"alarm (step {step}): {text}")

    def message(self, text: str) -> None:
        self._write_log(text)
        self.console.print(text, highlight=False, soft_wrap=True)
