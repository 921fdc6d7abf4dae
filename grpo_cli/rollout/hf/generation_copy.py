"""An hf engine on its own Hugging Face copy of the checkpoint rather than the policy's module: the Ray actors'
engine, and the trainer's when its backend has no Hugging Face model to share (megatron). Weight sync keeps the copy
current."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.rollout.base import EngineContext, RolloutEngine, engine_dtype

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig


def load_engine_model(cfg: GRPOConfig, model_path: str, *, device=None):
    """The checkpoint at `model_path` as a frozen Hugging Face model in the engine's dtype (`rollout.dtype`, `auto`:
    `model.dtype`) on `device` (default CPU)."""
    import torch
    from transformers import AutoConfig

    from grpo_cli.models.attention import attention_implementation
    from grpo_cli.models.vision import causal_lm_class

    model = causal_lm_class(AutoConfig.from_pretrained(model_path)).from_pretrained(
        model_path, dtype=getattr(torch, engine_dtype(cfg)),
        attn_implementation=attention_implementation(cfg.model.attn_implementation))
    return model.to(device or "cpu").eval().requires_grad_(False)


def hf_copy_engine(cfg: GRPOConfig, ctx: EngineContext, *, device=None) -> RolloutEngine:
    """An `HFEngine` on `load_engine_model(ctx.model_path)` (`shares_policy_weights` False)."""
    from grpo_cli.rollout.hf.engine import HFEngine, image_processor, require_compilable

    model = load_engine_model(cfg, ctx.model_path, device=device)
    if cfg.rollout.compile:
        require_compilable(model)
    return HFEngine(model, eos_token_ids=ctx.eos_token_ids, pad_token_id=ctx.pad_token_id,
                    shares_policy_weights=False, compile_step=cfg.rollout.compile,
                    images=image_processor(cfg, ctx), rank=ctx.rank)
