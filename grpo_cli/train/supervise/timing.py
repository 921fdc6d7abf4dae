"""Phase timers and memory readings for the step breakdown: seconds per phase, the device allocator's peaks per step
and per phase (CUDA; `runtime.accel` reads them), the process's peak RSS."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections import defaultdict

import torch

from grpo_cli.runtime.accel import device_in_use_mb, on_memory_change, peak_memory_mb, reset_peak_memory


def device_peak_mb(peaks: dict[str, float], now: dict[str, float]) -> float:
    """The device's use at its peak since the last reading: what it has in use now (`device_in_use_mb`) plus how far
    the allocator's reserve had risen above what it holds now. Memory a sleeping engine unmapped is on the allocator's
    books at both ends, so it cancels out. Exact while no engine slept or woke in between (the allocator's books
    cannot tell): a sleeping engine calls `accel.memory_changing` at both, which takes a reading there."""
    return now["used"] + max(0.0, peaks["reserved"] - now["reserved"])


class PeakMemory:
    """The peaks since the last `pop`: the device allocator's, `memory/cuda_peak_allocated_mb` and `_reserved_mb` of
    the whole span and `memory/cuda_peak_allocated_mb/<phase>` of each phase, and the device's own
    (`memory/cuda_peak_device_mb`, and `/<phase>`: `device_peak_mb`), which, unlike the allocator's, leaves out a
    sleeping colocated engine's unmapped pool; nothing on a device without an allocator to read (CPU). The peaks are
    read and restarted at every phase boundary, so a phase's figure is its own and the span's is the largest of all
    readings (what ran between phases included)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, float] = {}
        self.phases: dict[str, dict[str, float]] = {"allocated": {}, "device": {}}
        self.open: list[str] = []
        reset_peak_memory(device)  # model loading is not the first step's
        on_memory_change(self.mark)  # a colocated engine's sleep and wake: a reading on each side

    def mark(self) -> None:
        """Fold the peaks since the last mark into the span's and every open phase's, then restart them."""
        peaks = peak_memory_mb(self.device)
        if not peaks:
            return
        peaks["device"] = device_peak_mb(peaks, device_in_use_mb(self.device))
        for kind, mb in peaks.items():
            self.peaks[kind] = max(self.peaks.get(kind, 0.0), mb)
        for kind, phases in self.phases.items():
            for name in self.open:
                phases[name] = max(phases.get(name, 0.0), peaks[kind])
        reset_peak_memory(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.mark()
        self.open.append(name)
        try:
            yield
        finally:
            self.mark()
            self.open.remove(name)

    def pop(self) -> dict[str, float]:
        self.mark()
        out = {f"memory/cuda_peak_{kind}_mb": mb for kind, mb in self.peaks.items()}
        for kind, phases in self.phases.items():
            out.update({f"memory/cuda_peak_{kind}_mb/{name}": mb for name, mb in phases.items()})
        self.peaks, self.phases = {}, {kind: {} for kind in self.phases}
        return out


class PhaseTimer:
    """Accumulates wall seconds per named phase, and the allocator's peaks of `device` (`PeakMemory`; none on
    CPU); `current` names the running phase (for stall reports)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.current: str | None = None
        self.started_at: float = time.monotonic()
        self.memory = PeakMemory(torch.device(device))

    @contextlib.contextmanager
    def phase(self, name: str):
        self.current, self.started_at = name, time.monotonic()
        start = time.perf_counter()
        try:
            with self.memory.phase(name):
                yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.current = None

    def pop(self) -> dict[str, float]:
        """`time/<phase>` and `memory/cuda_peak_*` metrics since the last pop."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        self.seconds = defaultdict(float)
        return {**out, **self.memory.pop()}


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
