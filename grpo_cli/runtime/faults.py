"""Fault injection for rehearsals and tests: `GRPO_INJECT_FAULT` (an environment variable, never a config key) names
failures that `grpo train` and `grpo serve-rollout` cause on purpose, so their handling runs from the command line."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from grpo_cli.config.errors import UserError

ENV = "GRPO_INJECT_FAULT"

FIELDS = {"nonfinite_loss": ("rank", "step"), "kill": ("rank", "step"), "server_hang": ("step",)}
"""Each fault's fields; `rank` may be left out (rank 0)."""

FORMS = "nonfinite_loss:rank=R:step=S, kill:rank=R:step=S, server_hang:step=S"

_WHAT = {
    "nonfinite_loss": "the loss of rank {rank} at step {step} is NaN (train.on_nonfinite decides what follows)",
    "kill": "rank {rank} SIGKILLs itself at the start of step {step} (resume from the last checkpoint)",
    "server_hang": "`grpo serve-rollout` stops answering from the rollout of step {step} (trainer: "
                   "rollout.server.on_failure decides)",
}


class FaultSpecError(UserError):
    """A malformed `GRPO_INJECT_FAULT`."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    """Steps count from 1, as in the log and metrics.jsonl."""
    rank: int = 0

    def describe(self) -> str:
        return _WHAT[self.kind].format(rank=self.rank, step=self.step)


def _fault(text: str, whole: str) -> Fault:
    kind, *parts = text.strip().split(":")
    if kind not in FIELDS:
        raise _bad(whole, f"unknown fault '{kind}'")
    values: dict[str, int] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in FIELDS[kind] or key in values:
            raise _bad(whole, f"'{part}' is not a field of {kind} (it takes {', '.join(FIELDS[kind])}, once each)")
        if not value.isdigit():
            raise _bad(whole, f"{key} must be a whole number, got '{value}'")
        values[key] = int(value)
    if values.get("step", 0) < 1:
        raise _bad(whole, f"{kind} needs step=S with S >= 1 (steps count from 1, as in the log)")
    return Fault(kind, **values)


def _bad(whole: str, why: str) -> FaultSpecError:
    return FaultSpecError(f"{ENV}='{whole}' is malformed: {why}. It takes one or more faults separated by ',': "
                          f"{FORMS} (rank=R may be left out: rank 0); unset {ENV} for a run without injected faults.")


@dataclass(frozen=True)
class FaultPlan:
    """The faults `GRPO_INJECT_FAULT` asks for (none when it is unset or empty)."""

    faults: tuple[Fault, ...] = ()
    spec: str = ""

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """`spec` as `GRPO_INJECT_FAULT` holds it; FaultSpecError (exit 2) names the accepted forms."""
        if not spec.strip():
            return cls()
        return cls(tuple(_fault(part, spec) for part in spec.split(",")), spec)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultPlan:
        return cls.parse(environ.get(ENV, ""))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _at(self, kind: str, step: int, rank: int = 0) -> bool:
        return any(f.kind == kind and f.step == step and f.rank == rank for f in self.faults)

    def nonfinite_loss(self, *, rank: int, step: int) -> bool:
        """Whether rank `rank`'s loss at `step` is to be NaN."""
        return self._at("nonfinite_loss", step, rank)

    def kill_if_due(self, *, rank: int, step: int) -> None:
        """SIGKILL this process when a `kill` fault names this rank and step: no handler, no checkpoint, as when a
        machine dies."""
        if self._at("kill", step, rank):
            os.kill(os.getpid(), signal.SIGKILL)

    def server_hang_step(self) -> int | None:
        """The step from whose rollout a `grpo serve-rollout` server stops answering (None: it keeps answering)."""
        return min((f.step for f in self.faults if f.kind == "server_hang"), default=None)

    def banner(self) -> str:
        """The line a run prints once (rank 0) when faults are injected."""
        what = "; ".join(f.describe() for f in self.faults)
        return (f"!!! FAULT INJECTION: {ENV}='{self.spec}' is set, so this run fails on purpose: {what}. "
                f"Unset {ENV} for a real run. !!!")
