"""The one value the hf decode loop reads from the device each step, the finished-row count, and when the loop may
launch step t + 1 before reading step t's count (the decode loop: `decode._sample`).

Launching first keeps an asynchronous device (CUDA) busy while the host waits for the count; the price of
guessing wrong (the count says rows are dropped after step t, so step t + 1 runs again on the kept rows) is one
step of device time, against a host launch's latency (~0.1 ms of idle device) for reading the count first. The loop
launches first when the chance that step t drops rows, under the stop rate seen so far in this decode, is at most
`RISK`."""

from __future__ import annotations

import math

import torch

from grpo_cli.runtime import accel

RISK = 0.05
"""Launch step t + 1 before reading step t's finished count when P(step t drops rows) ≤ this: the break-even of one
lost step (~2 ms on the 151M model on an H100) against a host launch's idle device (~0.1 ms) per read-first step."""


def runs_ahead(device: torch.device) -> bool:
    """Whether the lean decode may launch a step before it reads the previous step's count: where the device runs
    asynchronously from the host (CUDA); on the CPU there is nothing to overlap and a rerun step is paid in full."""
    return accel.is_cuda(device)


def at_least(k: int, n: int, p: float) -> float:
    """P(X ≥ k) for X ~ Binomial(n, p): 1 for k ≤ 0, 0 for k > n."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_q, log_p, top = math.log1p(-p), math.log(p), math.lgamma(n + 1)
    below = sum(math.exp(top - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
                for i in range(k))  # in logs: comb(n, i) overflows a float past ~1,000 rows
    return max(0.0, 1.0 - below)


class FinishedCount:
    """The finished-row count of each step: `put` (done.sum() on the device), `read` it on the host through
    `accel.HostReadback` (on CUDA: a pinned copy and an event, so a step launched between the two keeps the device
    busy meanwhile).

    It also keeps the decode's stop rate: rows that stopped over row-steps run unfinished (`hazard`), so that
    `launch_first` can weigh the chance that a step reaches the count that drops rows."""

    def __init__(self, device: torch.device) -> None:
        self.value = accel.HostReadback(device)
        self.known = 0  # finished rows among the active ones, as of the last count read
        self.stops = self.exposure = 0

    def put(self, done: torch.Tensor) -> None:
        self.value.put(done.sum())

    def read(self, rows: int) -> int:
        """The count `put` last, of `rows` active rows."""
        count = self.value.get()
        self.stops += count - self.known  # rows that stopped at this step, of the rows - known that ran unfinished
        self.exposure += rows - self.known
        self.known = count
        return count

    def dropped(self) -> None:
        """The finished rows left the batch: none of the active rows is finished."""
        self.known = 0

    def launch_first(self, rows: int, threshold: float) -> bool:
        """Whether P(the unfinished rows' stops at the step being read bring the count to `threshold`) ≤ `RISK`,
        for stops ~ Binomial(unfinished rows, hazard), hazard = stops / row-steps so far (0 before any stop)."""
        hazard = self.stops / self.exposure if self.exposure else 0.0
        return at_least(math.ceil(threshold) - self.known, rows - self.known, hazard) <= RISK
