"""The run directory: resolved config, metrics.jsonl, completions.jsonl, summary.json (with the run's memory
peaks)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from grpo_cli.config.load import dump_config
from grpo_cli.config.schema import GRPOConfig

SUMMARY_PEAKS = ("memory/cuda_peak_allocated_mb", "memory/cuda_peak_reserved_mb", "memory/cuda_peak_device_mb",
                 "memory/peak_rss_mb")
"""Per-step peaks whose largest value over the run goes into summary.json, under the same names."""


def default_output_dir(cfg: GRPOConfig) -> Path:
    return Path("runs") / f"{cfg.preset or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}"


def _row(line: str) -> dict:
    """A metrics.jsonl line as a dict ({} for a half-written or unreadable one)."""
    try:
        row = json.loads(line)
    except ValueError:
        return {}
    return row if isinstance(row, dict) else {}


def _clean(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class RunDir:
    """Append-only writers for one run; the config is written once at start. `peaks`: the largest of each
    `SUMMARY_PEAKS` metric over every step in metrics.jsonl (a resumed run's earlier steps included)."""

    def __init__(self, path: Path, cfg: GRPOConfig) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.yaml").write_text(dump_config(cfg))
        self.peaks: dict[str, float] = {}
        if (path / "metrics.jsonl").is_file():
            for line in (path / "metrics.jsonl").read_text().splitlines():
                self._fold_peaks(_row(line))
        self._metrics = open(path / "metrics.jsonl", "a", buffering=1)
        self._samples = open(path / "completions.jsonl", "a", buffering=1)

    def log_step(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        row = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        self._fold_peaks(row)
        self._metrics.write(json.dumps(row) + "\n")
        for s in samples:
            self._samples.write(json.dumps(s) + "\n")

    def _fold_peaks(self, row: dict) -> None:
        for key in SUMMARY_PEAKS:
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.peaks[key] = max(self.peaks.get(key, value), value)

    def write_summary(self, summary: dict) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
