"""Stall detection: a daemon thread warns (with a stack dump to the log) when one phase runs too long."""

from __future__ import annotations

import faulthandler
import threading
import time
from pathlib import Path

from grpo_cli.train.supervise.timing import PhaseTimer


class StallWatchdog:
    """Every few seconds, checks `timer.current`; past `minutes` in one phase, calls `warn` once per stall and
    appends all thread stacks to `dump_path`."""

    def __init__(self, timer: PhaseTimer, *, minutes: float, warn, dump_path: Path, poll_s: float = 5.0) -> None:
        self.timer, self.limit, self.warn, self.dump_path, self.poll = timer, minutes * 60, warn, dump_path, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpo-stall-watchdog", daemon=True)
        self._reported: tuple[str, float] | None = None

    def __enter__(self) -> StallWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            phase, since = self.timer.current, self.timer.started_at
            if phase is None or time.monotonic() - since < self.limit or self._reported == (phase, since):
                continue
            self._reported = (phase, since)
            minutes = (time.monotonic() - since) / 60
            self.warn(f"warning: phase '{phase}' has made no progress for {minutes:.1f} min; "
                      f"stacks dumped to {self.dump_path}")
            with open(self.dump_path, "a") as f:
                f.write(f"--- stall in phase {phase} after {minutes:.1f} min ---\n")
                faulthandler.dump_traceback(file=f, all_threads=True)
