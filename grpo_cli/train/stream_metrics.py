"""Stream mode's metrics (docs/streaming.md): per-token version lag and mixed-version rows of a step's groups, and
the share of server time with nothing generating."""

from __future__ import annotations

import time

from grpo_cli.rollout.vllm_serve.stream import Group


def batch_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """`stream/version_lag_mean` and `_max`: over every sampled token, the versions between the weights that sampled
    it and `version` (the weights that train on it); `stream/mixed_version_rows`: completions whose tokens span
    more than one version."""
    lags = [version - v for g in groups for row in g.token_versions for v in row]
    return {"stream/version_lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "stream/version_lag_max": float(max(lags, default=0)),
            "stream/mixed_version_rows": float(sum(g.mixed_rows() for g in groups))}


class IdleClock:
    """Per server, the time it had no group in flight; `idle_fraction` reads it (and resets it) once a step."""

    def __init__(self, urls: list[str], clock=time.perf_counter) -> None:
        self.clock = clock
        self.busy = dict.fromkeys(urls, False)
        self.idle = dict.fromkeys(urls, 0.0)
        self.since = dict.fromkeys(urls, clock())
        self.window_start = clock()
        self.paused_at_start = 0.0

    def set(self, url: str, in_flight: int) -> None:
        """The server now has `in_flight` groups (call under the pool's lock after every change)."""
        now = self.clock()
        if not self.busy[url]:
            self.idle[url] += now - self.since[url]
        self.busy[url], self.since[url] = in_flight > 0, now

    def idle_fraction(self, paused_seconds: float) -> float:
        """`stream/engine_idle_frac` since the last call: the share of server time with no group in flight, plus
        the time every server spent paused for weight updates (`paused_seconds`: the client's running total)."""
        now = self.clock()
        for url in self.busy:
            self.set(url, 1 if self.busy[url] else 0)
        span = (now - self.window_start) * len(self.busy)
        paused = (paused_seconds - self.paused_at_start) * len(self.busy)
        idle = min(span, sum(self.idle.values()) + paused)
        self.idle = dict.fromkeys(self.busy, 0.0)
        self.window_start, self.paused_at_start = now, paused_seconds
        return idle / span if span > 0 else 0.0
