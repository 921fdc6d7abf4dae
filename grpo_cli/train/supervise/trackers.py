"""Optional experiment trackers (`logging.report_to`: tensorboard, wandb) through accelerate's tracker classes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from grpo_cli.config.errors import UserError
from grpo_cli.config.schema import GRPOConfig

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def open_trackers(cfg: GRPOConfig, run_dir: Path) -> list:
    """Started accelerate trackers for `logging.report_to` (checked before training starts)."""
    from accelerate.tracking import TensorBoardTracker, WandBTracker

    trackers = []
    for name in cfg.logging.report_to:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(f"logging.report_to includes '{name}' but the {PACKAGES[name]} package is not "
                            f"installed; run `pip install {PACKAGES[name]}` or remove it from logging.report_to.")
        tracker = (TensorBoardTracker(run_dir.name, run_dir / "tensorboard") if name == "tensorboard"
                   else WandBTracker(run_dir.name))
        tracker.start()
        tracker.store_init_configuration(_flat(cfg.model_dump(mode="json")))
        trackers.append(tracker)
    return trackers


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def log_trackers(trackers: list, step: int, metrics: dict[str, float]) -> None:
    finite = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v == v}
    for tracker in trackers:
        tracker.log(finite, step=step)


def close_trackers(trackers: list) -> None:
    for tracker in trackers:
        tracker.finish()
