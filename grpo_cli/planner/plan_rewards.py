"""`grpo plan`'s rows of the local reward models and judges (`rewards.functions`): their dtype, parameters and bytes
(where each runs and whether it is parked: `config/reward_models.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.config.judge import JUDGE, is_url
from grpo_cli.config.model_shape import BYTES, local_model_config, model_shape
from grpo_cli.config.reward_models import device_setting, reward_models

if TYPE_CHECKING:
    from grpo_cli.config.rewards import RewardFunctionConfig
    from grpo_cli.config.schema import GRPOConfig


def local_judges(cfg: GRPOConfig) -> list[RewardFunctionConfig]:
    """The judge entries (`config.judge`) whose judge is a local checkpoint, loaded in the training process."""
    return [f for f in cfg.rewards.functions if f.name == JUDGE and not is_url(str(f.kwargs.get("judge", "")))]


def reward_model_dtype(cfg: GRPOConfig, entry: RewardFunctionConfig) -> str:
    """The dtype the reward model (or local judge) is loaded in: its `dtype` kwarg, else the compute dtype
    `model.dtype`."""
    return str(entry.kwargs.get("dtype") or cfg.model.dtype)


def reward_model_params(path: str) -> float:
    """Parameters of a sequence-classification checkpoint: the decoder of its config.json (`model_shape`) with a
    `hidden × num_labels` score head instead of the language-model head (a name without a local folder: the
    decoder's size from the name, head included)."""
    shape, c = model_shape(path), local_model_config(path)
    if c is None:
        return shape.params
    labels = len(c.get("id2label") or {}) or int(c.get("num_labels", 1))
    lm_head = 0 if c.get("tie_word_embeddings") else shape.vocab * shape.hidden
    return shape.params - lm_head + shape.hidden * labels


def reward_model_bytes(cfg: GRPOConfig, *, on_device: bool) -> float:
    """Bytes of the local reward models' and local judges' parameters in their dtype: those on an accelerator
    (`on_device`), or those on the CPU; each training process loads its own copy."""
    models = [(reward_model_params(str(f.kwargs["model"])), f) for f in reward_models(cfg)]
    judges = [(model_shape(str(f.kwargs["judge"])).params, f) for f in local_judges(cfg)]
    return sum(params * BYTES[reward_model_dtype(cfg, f)] for params, f in models + judges
               if (device_setting(cfg, f) != "cpu") == on_device)
