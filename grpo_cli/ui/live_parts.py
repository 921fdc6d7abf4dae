"""Pieces of the live training view: progress line, sparkline, phase-time bar, memory line, sample panel (rich
renderables)."""

from __future__ import annotations

import math

from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

PHASES = ("generate", "reward", "logprobs", "train", "sync", "offload")
PHASE_COLORS = {"generate": "green", "reward": "magenta", "logprobs": "blue", "train": "yellow", "sync": "cyan",
                "offload": "white"}
BLOCKS = "▁▂▃▄▅▆▇█"
GPU_ALLOCATED, GPU_RESERVED = "memory/cuda_peak_allocated_mb", "memory/cuda_peak_reserved_mb"
GPU_DEVICE = "memory/cuda_peak_device_mb"
"""The device's own use at its peak (`train.supervise.timing.device_peak_mb`): a sleeping engine's unmapped pool,
which the allocator's books still count, left out. Shown first, and per phase, when logged."""
RSS = "memory/peak_rss_mb"


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or value != value else format(value, spec)


def clock(seconds: float | None) -> str:
    """H:MM:SS, or `-:--:--` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def sparkline(values: list[float]) -> str:
    """One block character per value, scaled between the min and max of `values`; NaN is a space."""
    finite = [v for v in values if v == v]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    top = len(BLOCKS) - 1
    return "".join(" " if v != v else BLOCKS[0 if hi == lo else round((v - lo) / (hi - lo) * top)] for v in values)


def duration(seconds: float) -> str:
    """A phase's time, never a false zero: `2.55s`, `0.60s` from 0.1 s up, milliseconds below (`30ms`, `4.2ms`,
    `0.31ms`; at 20 steps/s most phases take a few ms, which two decimals of seconds showed as `0.00s`), `0s` for
    none."""
    if seconds >= 0.0995:  # rounds to 0.10s
        return f"{seconds:.2f}s"
    if seconds <= 0:
        return "0s"
    ms = seconds * 1000
    return f"{ms:.0f}ms" if ms >= 9.95 else f"{ms:.2g}ms"


def rate_text(steps_per_s: float | None) -> str:
    """`0.21 steps/s (4.8 s/step)`; under a second a step, milliseconds (`20.00 steps/s (50 ms/step)`)."""
    if not steps_per_s:
        return "- steps/s"
    seconds = 1 / steps_per_s
    per_step = f"{seconds:.1f} s/step" if seconds >= 1 else f"{seconds * 1000:.0f} ms/step"
    return f"{steps_per_s:.2f} steps/s ({per_step})"


def progress_line(step: int, total: int, *, elapsed: float, eta: float | None, steps_per_s: float | None) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_row(Text("step", style="bold"), ProgressBar(total=max(total, 1), completed=step, width=30),
                 Text(f"{step}/{total}"), Text(f"elapsed {clock(elapsed)}"), Text(f"ETA {clock(eta)}", style="cyan"),
                 Text(rate_text(steps_per_s)))
    return grid


def trend_line(label: str, values: list[float], *, style: str) -> Text:
    """`reward ▁▂▄▆█ -1.250 (min -4.000, max -1.250)` over the recent values."""
    finite = [v for v in values if v == v]
    text = Text(f"{label:<7}", style="bold")
    text.append(sparkline(values), style=style)
    if finite:
        text.append(f" {fmt(values[-1])}  (min {fmt(min(finite))}, max {fmt(max(finite))}, last {len(values)} steps)")
    return text


def phase_bar(metrics: dict[str, float], *, width: int = 30) -> Text:
    """A stacked bar of the step's phase times, each phase a colour, then the seconds of each."""
    times = {p: metrics.get(f"time/{p}", 0.0) for p in PHASES if metrics.get(f"time/{p}", 0.0) > 0}
    total = sum(times.values())
    text = Text("phases ", style="bold")
    if not total:
        return text.append("-")
    for p, t in times.items():
        text.append("█" * max(1, round(t / total * width)), style=PHASE_COLORS[p])
    text.append(" ")
    for p, t in times.items():
        text.append(f"{p} ", style=PHASE_COLORS[p]).append(f"{duration(t)}  ")
    return text


def memory_line(metrics: dict[str, float]) -> Text | None:
    """`memory GPU peak 5678 MB in use, allocator 1234 MB allocated / 2345 MB reserved (by phase: train 5678, generate
    800)  RSS 3456 MB`: the step's peaks (the largest over ranks), the device's own use first and per phase (the
    allocator's per phase where no device figure was logged), the process's peak RSS; None without any."""
    parts = []
    if GPU_ALLOCATED in metrics:
        by = GPU_DEVICE if GPU_DEVICE in metrics else GPU_ALLOCATED
        gpu = f"GPU peak {fmt(metrics[GPU_DEVICE], '.0f')} MB in use, allocator " if by == GPU_DEVICE else "GPU peak "
        gpu += (f"{fmt(metrics[GPU_ALLOCATED], '.0f')} MB allocated"
                f"{' / ' if by == GPU_DEVICE else ', '}{fmt(metrics.get(GPU_RESERVED), '.0f')} MB reserved")
        phases = sorted(((k.removeprefix(by + "/"), v) for k, v in metrics.items() if k.startswith(by + "/")),
                        key=lambda kv: -kv[1])
        if phases:
            gpu += " (by phase: " + ", ".join(f"{p} {fmt(v, '.0f')}" for p, v in phases) + ")"
        parts.append(gpu)
    if RSS in metrics:
        parts.append(f"RSS {fmt(metrics[RSS], '.0f')} MB")
    return Text("memory ", style="bold").append("  ".join(parts)) if parts else None


def memory_plain(metrics: dict[str, float]) -> str:
    """` gpu_mem=1234/2345MB` (peak allocated/reserved) on CUDA, then ` gpu_used=5678MB` (the device's own peak) when
    logged, else ` rss=3456MB`, else ``."""
    if GPU_ALLOCATED in metrics:
        used = f" gpu_used={fmt(metrics[GPU_DEVICE], '.0f')}MB" if GPU_DEVICE in metrics else ""
        return f" gpu_mem={fmt(metrics[GPU_ALLOCATED], '.0f')}/{fmt(metrics.get(GPU_RESERVED), '.0f')}MB{used}"
    return f" rss={fmt(metrics[RSS], '.0f')}MB" if RSS in metrics else ""


def sample_panel(sample: dict | None, *, step: int, max_chars: int = 240) -> Panel:
    """The first logged completion of the step, truncated, with its reward."""
    if not sample:
        return Panel(Text("no completion logged (logging.log_completions: 0)", style="dim"), title="sample")
    body = Text()
    body.append("prompt ", style="bold").append(truncate(str(sample.get("prompt", "")), max_chars // 2) + "\n")
    body.append("completion ", style="bold").append(truncate(str(sample.get("completion", "")), max_chars))
    title = f"sample (step {step}, reward {fmt(sample.get('reward'))})"
    return Panel(body, title=title, title_align="left")


def truncate(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
