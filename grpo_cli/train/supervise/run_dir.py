"""The run directory: resolved config, metrics.jsonl, completions.jsonl, summary.json."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from grpo_cli.config.load import dump_config
from grpo_cli.config.schema import GRPOConfig


def default_output_dir(cfg: GRPOConfig) -> Path:
    return Path("runs") / f"{cfg.preset or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}"


def _clean(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


class RunDir:
    """Append-only writers for one run; the config is written once at start."""

    def __init__(self, path: Path, cfg: GRPOConfig) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.yaml").write_text(dump_config(cfg))
        self._metrics = open(path / "metrics.jsonl", "a", buffering=1)
        self._samples = open(path / "completions.jsonl", "a", buffering=1)

    def log_step(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        row = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        for s in samples:
            self._samples.write(json.dumps(s) + "\n")

    def write_summary(self, summary: dict) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
