"""Worker for test_memory_metrics: one rank of a 2-rank gloo group reducing step metrics with `mean_metrics`.

Run: `mean_metrics_worker.py OUT` with RANK/WORLD_SIZE/MASTER_* set. Writes `OUT/rank{r}.json`: the reduced metrics
of rank-dependent values (rank 0 and rank 1 differ in every key)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from grpo_cli.runtime.dist import init_from_env, mean_metrics, shutdown


def main(out: str) -> None:
    info = init_from_env(torch.device("cpu"), timeout_minutes=2)
    r = info.rank
    metrics = {"loss": 1.0 + r, "memory/cuda_peak_allocated_mb": 100.0 + 300 * r,
               "memory/cuda_peak_reserved_mb": 900.0 - 500 * r, "memory/cuda_peak_allocated_mb/train": 50.0 * (r + 1),
               "memory/peak_rss_mb": 2000.0 + r, "time/step": 2.0 * (r + 1)}
    reduced = mean_metrics(metrics, info)
    (Path(out) / f"rank{r}.json").write_text(json.dumps(reduced))
    shutdown(info)


if __name__ == "__main__":
    main(sys.argv[1])
