"""Cache-aware routing over a pool of rollout servers: new groups go to the least-loaded server (requests in flight
from this client), every later turn of a multi-turn trajectory to the server that served its first turn (its prefix
is in that server's cache) unless that server is overloaded (`rollout.server.sticky_max_excess`) or restarted."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

STICKY_CAPACITY = 1 << 16
"""Trajectories remembered at most (oldest forgotten first): a step's groups, many times over."""


def least_loaded(loads: Sequence[int]) -> int:
    """The index of the smallest load; ties go to the lowest index."""
    return min(range(len(loads)), key=lambda i: (loads[i], i))


def fill(loads: Sequence[int], count: int, weight: int) -> list[int]:
    """Servers for `count` new groups of `weight` requests each, in order: each to the least-loaded server, counting
    the groups placed before it. The servers come out sorted, so groups on one server are contiguous."""
    loads = list(loads)
    picks = []
    for _ in range(count):
        i = least_loaded(loads)
        loads[i] += weight
        picks.append(i)
    return sorted(picks)


def overloaded(loads: Sequence[int], server: int, *, max_excess: int) -> bool:
    """Whether `server` holds more than `max_excess` requests in flight beyond the least-loaded server."""
    return loads[server] - min(loads) > max_excess


def runs(servers: Sequence[int]) -> list[tuple[int, slice]]:
    """Maximal runs of consecutive items on one server: (server, slice of the items), in order."""
    out: list[tuple[int, slice]] = []
    start = 0
    for i in range(1, len(servers) + 1):
        if i == len(servers) or servers[i] != servers[start]:
            out.append((servers[start], slice(start, i)))
            start = i
    return out


class Router:
    """Loads (requests placed and not yet answered) per server, the sticky map trajectory → server, and the figures
    `take_metrics` reports. Thread-safe: a client's requests run in a pool and a stream keeps several in flight."""

    def __init__(self, servers: int, *, max_excess: int) -> None:
        self.loads = [0] * servers
        self.peaks = [0] * servers
        self.max_excess = max_excess
        self.sticky: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        self.epochs = [0] * servers
        self.kept = self.moved = 0
        self._lock = threading.Lock()

    def place_new(self, keys: Sequence[Hashable], weight: int) -> list[int]:
        """Servers for new groups (`keys`, one per group, `weight` requests each), reserved until `done`."""
        with self._lock:
            picks = fill(self.loads, len(keys), weight)
            for key, server in zip(keys, picks, strict=True):
                self._remember(key, server)
                self._add(server, weight)
            return picks

    def place_turns(self, keys: Sequence[Hashable], weight: int) -> list[int]:
        """Servers for later turns of the trajectories `keys`: the one that served the first turn while it is
        neither overloaded nor restarted since, else the least loaded (which the trajectory then sticks to)."""
        with self._lock:
            picks = []
            for key in keys:
                server, epoch = self.sticky.get(key, (None, None))
                if server is not None and epoch == self.epochs[server] and not overloaded(
                        self.loads, server, max_excess=self.max_excess):
                    self.kept += 1
                else:
                    self.moved += server is not None
                    server = least_loaded(self.loads)
                    self._remember(key, server)
                self._add(server, weight)
                picks.append(server)
            return picks

    def done(self, server: int, weight: int) -> None:
        """A request placed on `server` was answered (or failed)."""
        with self._lock:
            self.loads[server] -= weight

    def forget(self, server: int) -> None:
        """`server` restarted (its weight version or identity changed): its cache is gone, so trajectories that
        stuck to it are placed again by load."""
        with self._lock:
            self.epochs[server] += 1

    def take_metrics(self) -> dict[str, float]:
        """`rollout/server_load/<i>` (the most requests in flight on server i since the last take), their mean and
        max, and the fraction of later turns that stayed on their first server; then starts counting afresh."""
        with self._lock:
            out = {f"rollout/server_load/{i}": float(p) for i, p in enumerate(self.peaks)}
            out["rollout/server_load/mean"] = sum(self.peaks) / len(self.peaks)
            out["rollout/server_load/max"] = float(max(self.peaks))
            if self.kept + self.moved:
                out["rollout/sticky_kept"] = self.kept / (self.kept + self.moved)
            self.peaks = list(self.loads)
            self.kept = self.moved = 0
            return out

    def _add(self, server: int, weight: int) -> None:
        self.loads[server] += weight
        self.peaks[server] = max(self.peaks[server], self.loads[server])

    def _remember(self, key: Hashable, server: int) -> None:
        self.sticky[key] = (server, self.epochs[server])
        self.sticky.move_to_end(key)
        while len(self.sticky) > STICKY_CAPACITY:
            self.sticky.popitem(last=False)


CACHE_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
"""vLLM's prefix-cache counters on its Prometheus `/metrics` (tokens looked up, tokens found), one per engine."""


def prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) summed over label sets from a Prometheus exposition; None when the server reports neither."""
    sums = dict.fromkeys(CACHE_COUNTERS, 0.0)
    seen = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
            seen = True
    return (sums[CACHE_COUNTERS[0]], sums[CACHE_COUNTERS[1]]) if seen else None


class CacheMeter:
    """The servers' prefix-cache hit rate between two readings of their counters (a counter that went down: the
    server restarted, its counting started again from 0)."""

    def __init__(self, servers: int) -> None:
        self.last: list[tuple[float, float] | None] = [None] * servers

    def take_metrics(self, readings: Sequence[tuple[float, float] | None]) -> dict[str, float]:
        """`rollout/prefix_cache_hit_rate/<i>` and overall, over the tokens looked up since the last reading."""
        out, total_q, total_h = {}, 0.0, 0.0
        for i, now in enumerate(readings):
            if now is None:
                continue
            before = self.last[i] if self.last[i] is not None and self.last[i][0] <= now[0] else (0.0, 0.0)
            self.last[i] = now
            queries, hits = now[0] - before[0], now[1] - before[1]
            if queries > 0:
                out[f"rollout/prefix_cache_hit_rate/{i}"] = hits / queries
                total_q, total_h = total_q + queries, total_h + hits
        if total_q > 0:
            out["rollout/prefix_cache_hit_rate"] = total_h / total_q
        return out
