"""Local reward models (`rewards.functions` entries `{model: PATH}`): where each one runs, in which dtype, whether it
waits in host memory while the rollout engine generates, and its size; what the reward resolver, the config rules
and `grpo plan` read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.config.model_shape import local_model_config, model_shape
from grpo_cli.config.plan_megatron import BYTES

if TYPE_CHECKING:
    from grpo_cli.config.rewards import RewardFunctionConfig
    from grpo_cli.config.schema import GRPOConfig

REWARD_MODEL = "reward_model"
"""The built-in reward function behind `{model: PATH}`."""


def reward_models(cfg: GRPOConfig) -> list[RewardFunctionConfig]:
    """The `reward_model` entries that name their checkpoint (`model`)."""
    return [f for f in cfg.rewards.functions if f.name == REWARD_MODEL and f.kwargs.get("model")]


def local_judges(cfg: GRPOConfig) -> list[RewardFunctionConfig]:
    """The judge entries (`config.judge`) whose judge is a local checkpoint, loaded in the training process."""
    from grpo_cli.config.judge import JUDGE, is_url

    return [f for f in cfg.rewards.functions if f.name == JUDGE and not is_url(str(f.kwargs.get("judge", "")))]


def device_setting(cfg: GRPOConfig, entry: RewardFunctionConfig) -> str:
    """The entry's `device` (default `cpu`); `auto` is the training device, so it reads `distributed.device`."""
    setting = str(entry.kwargs.get("device", "cpu"))
    return cfg.distributed.device if setting == "auto" else setting


def reward_model_dtype(cfg: GRPOConfig, entry: RewardFunctionConfig) -> str:
    """The dtype the reward model (or local judge) is loaded in: its `dtype` kwarg, else the compute dtype
    `model.dtype`."""
    return str(entry.kwargs.get("dtype") or cfg.model.dtype)


def parks_reward_models(cfg: GRPOConfig) -> bool:
    """Whether a reward model waits in host memory except while it scores: when the rollout engine generates on the
    training device (colocate mode) and the run makes room for it there (colocated vLLM, or `distributed.offload`
    on). Otherwise it stays on its device for the whole run."""
    r = cfg.rollout
    return r.colocated_vllm or (r.colocated and any(cfg.distributed.offload.model_dump().values()))


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
