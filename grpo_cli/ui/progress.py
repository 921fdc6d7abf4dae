"""Live training view (rich) on a terminal, one plain line per step otherwise."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

PHASES = ("generate", "reward", "logprobs", "train", "sync")


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or value != value else format(value, spec)


def _phase_text(metrics: dict[str, float]) -> str:
    return " ".join(f"{p}={metrics.get(f'time/{p}', 0.0):.2f}s" for p in PHASES)


def _async_text(metrics: dict[str, float]) -> str:
    """Async mode: staleness of the batch and the actor's generation time (hidden behind training)."""
    if "async/in_flight" not in metrics:
        return ""
    return f" stale={_fmt(metrics.get('staleness'), '.0f')} actor_gen={_fmt(metrics.get('async/actor_generate_s'), '.2f')}s"


def _sampling_text(metrics: dict[str, float]) -> str:
    """Dynamic sampling: groups dropped (identical rewards) and prompts drawn in extra rounds this step."""
    if "dynamic_sampling/dropped_groups" not in metrics:
        return ""
    return (f" dropped={_fmt(metrics['dynamic_sampling/dropped_groups'], '.0f')}"
            f" redrawn={_fmt(metrics.get('dynamic_sampling/drawn_prompts'), '.0f')}")


class ProgressView:
    """Renders `update(step, metrics)` as a live table (mode rich) or as plain lines (mode plain/auto off-TTY)."""

    def __init__(self, total_steps: int, *, mode: str = "auto", console: Console | None = None) -> None:
        self.console = console or Console(stderr=False)
        self.total = total_steps
        self.rich = mode == "rich" or (mode == "auto" and sys.stdout.isatty())
        self.start = time.perf_counter()
        self.first_step: int | None = None
        self.live: Live | None = None

    def __enter__(self) -> ProgressView:
        if self.rich:
            self.live = Live(self._table(0, {}), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def _eta(self, step: int) -> float | None:
        if self.first_step is None or step <= self.first_step:
            return None
        rate = (time.perf_counter() - self.start) / (step - self.first_step)
        return rate * (self.total - step)

    def _table(self, step: int, m: dict[str, float]) -> Table:
        table = Table(title=f"grpo train — step {step}/{self.total}  ETA {_fmt(self._eta(step), '.0f')}s",
                      show_header=False, expand=False)
        table.add_column("metric", style="cyan")
        table.add_column("value", justify="right")
        rows = [
            ("reward mean ± std", f"{_fmt(m.get('reward/mean'))} ± {_fmt(m.get('reward/std'))}"),
            ("loss", _fmt(m.get("loss"), ".4f")),
            ("kl (ref)", _fmt(m.get("kl"), ".4f")),
            ("entropy", _fmt(m.get("entropy"), ".3f")),
            ("mismatch k3_kl", _fmt(m.get("rollout_correction/k3_kl"), ".2e")),
            ("completion length", _fmt(m.get("completions/mean_length"), ".1f")),
            ("tokens/s", _fmt(m.get("tokens_per_second"), ".0f")),
            ("phases", _phase_text(m)),
        ]
        if "async/in_flight" in m:
            rows.append(("async: staleness / in flight / actor gen",
                         f"{_fmt(m.get('staleness'), '.0f')} / {_fmt(m.get('async/in_flight'), '.0f')} / "
                         f"{_fmt(m.get('async/actor_generate_s'), '.2f')}s"))
        if "dynamic_sampling/dropped_groups" in m:
            rows.append(("dynamic sampling: groups dropped / prompts redrawn",
                         f"{_fmt(m.get('dynamic_sampling/dropped_groups'), '.0f')} / "
                         f"{_fmt(m.get('dynamic_sampling/drawn_prompts'), '.0f')}"))
        for name, value in rows:
            table.add_row(name, value)
        return table

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self.first_step is None:
            self.first_step, self.start = step, time.perf_counter()
        if self.live is not None:
            self.live.update(self._table(step, metrics))
            return
        self.console.print(
            f"step {step}/{self.total} reward={_fmt(metrics.get('reward/mean'))} "
            f"std={_fmt(metrics.get('reward/std'))} loss={_fmt(metrics.get('loss'), '.4f')} "
            f"kl={_fmt(metrics.get('kl'), '.4f')} tok/s={_fmt(metrics.get('tokens_per_second'), '.0f')} "
            f"{_phase_text(metrics)}{_async_text(metrics)}{_sampling_text(metrics)} eta={_fmt(self._eta(step), '.0f')}s",
            highlight=False, soft_wrap=True,
        )

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)
