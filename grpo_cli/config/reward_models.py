"""Local reward models (`rewards.functions` entries `{model: PATH}`): where each one runs, in which dtype, whether it
waits in host memory while the rollout engine generates: what the reward resolver, the config rules and `grpo plan`
read (their size: `planner/plan_rewards.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_cli.config.rewards import RewardFunctionConfig
    from grpo_cli.config.sections import GRPOSections

REWARD_MODEL = "reward_model"
"""The built-in reward function behind `{model: PATH}`."""


def reward_models(cfg: GRPOSections) -> list[RewardFunctionConfig]:
    """The `reward_model` entries that name their checkpoint (`model`)."""
    return [f for f in cfg.rewards.functions if f.name == REWARD_MODEL and f.kwargs.get("model")]


def device_setting(cfg: GRPOSections, entry: RewardFunctionConfig) -> str:
    """The entry's `device` (default `cpu`); `auto` is the training device, so it reads `distributed.device`."""
    setting = str(entry.kwargs.get("device", "cpu"))
    return cfg.distributed.device if setting == "auto" else setting


def parks_reward_models(cfg: GRPOSections) -> bool:
    """Whether a reward model waits in host memory except while it scores: when the rollout engine generates on the
    training device (colocate mode) and the run makes room for it there (colocated vLLM, or `distributed.offload`
    on). Otherwise it stays on its device for the whole run."""
    r = cfg.rollout
    return r.colocated_vllm or (r.colocated and any(cfg.distributed.offload.model_dump().values()))
