"""Phase timers and memory readings for the step breakdown."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections import defaultdict


class PhaseTimer:
    """Accumulates wall seconds per named phase; `current` names the running phase (for stall reports)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.current: str | None = None
        self.started_at: float = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.current, self.started_at = name, time.monotonic()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.current = None

    def pop(self) -> dict[str, float]:
        """`time/<phase>` metrics since the last pop."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        self.seconds = defaultdict(float)
        return out


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
