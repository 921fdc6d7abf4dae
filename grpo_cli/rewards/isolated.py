"""Reward functions with `isolation: process`: one call per completion in a pool of worker interpreters
(`runtime.workers.WorkerPool` running `rewards.worker`), so a reward that hangs, exits or exhausts memory costs
that sample's score (`on_error`), not the run."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

from grpo_cli.runtime.workers import WorkerPool

_POOLS: dict[tuple, WorkerPool] = {}


def _pool(rf) -> WorkerPool:
    key = (rf.name, rf.isolation["workers"], rf.isolation["memory_mb"])
    if key not in _POOLS:
        _POOLS[key] = WorkerPool("grpo_cli.rewards.worker", rf.isolation["workers"],
                                 memory_mb=rf.isolation["memory_mb"], scrub_env=True)
    return _POOLS[key]


def _one_sample(value, j: int, batch: int):
    """Sample j's part of a per-batch value (a column or an extra like `completion_ids`); scalars as they are."""
    return [value[j]] if isinstance(value, list) and len(value) == batch else value


def score_isolated(rf, prompts: list[str], completions: list[str], columns: dict[str, list],
                   extras: dict) -> list[float]:
    """One float (NaN for None or a failed call scored None) per completion, calls running `workers` at a time."""
    pool, b, iso = _pool(rf), len(completions), rf.isolation
    fallback = math.nan if iso["on_error"] is None else float(iso["on_error"])

    def one(j: int) -> float:
        request = {"name": rf.name, "kwargs": rf.kwargs, "prompt": prompts[j], "completion": completions[j],
                   "columns": {k: v[j] for k, v in columns.items()},
                   "extras": {k: _one_sample(v, j, b) for k, v in extras.items()}}
        reply, outcome = pool.call(request, iso["timeout_s"])
        if outcome != "ok" or reply["status"] != "ok":
            return fallback
        value = reply["value"]
        return math.nan if value is None else float(value)

    with ThreadPoolExecutor(max_workers=iso["workers"]) as threads:
        return list(threads.map(one, range(b)))
