"""Pick and build the rollout engine named by the config; heavy clients are imported only in their branch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.rollout.base import EngineContext, RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig


def sampling_params(cfg: GRPOConfig, *, seed: int | None) -> SamplingParams:
    """Sampling parameters of one rollout step, from `rollout.*` and the group size."""
    r = cfg.rollout
    return SamplingParams(
        n=cfg.train.generations_per_prompt,
        max_tokens=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=seed,
    )


def make_engine(cfg: GRPOConfig, ctx: EngineContext, *, policy=None, broadcast=None) -> RolloutEngine:
    """Build the engine for `cfg.rollout` (engine × mode). `policy` is the trainer's model (hf engine);
    `broadcast(obj)` shares rank 0's Ray address with the other ranks (async mode)."""
    r = cfg.rollout
    if r.mode == "async":
        from grpo_cli.rollout.ray_engine import AsyncRolloutEngine

        return AsyncRolloutEngine.from_config(cfg, ctx, broadcast=broadcast)
    if r.mode == "server":
        if r.engine == "sglang":
            from grpo_cli.rollout.sglang_client import SGLangEngine

            return SGLangEngine.from_config(cfg, ctx)
        from grpo_cli.rollout.server_client import ServerEngine

        return ServerEngine.from_config(cfg, ctx)
    if r.engine == "vllm":
        from grpo_cli.rollout.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(cfg, ctx)
    return make_hf_engine(cfg, ctx, policy=policy)


def make_hf_engine(cfg: GRPOConfig, ctx: EngineContext, *, policy) -> RolloutEngine:
    """The hf engine shares the policy's weights unless `rollout.dtype` asks for a copy in another dtype."""
    import torch

    from grpo_cli.rollout.hf import HFEngine

    if cfg.rollout.compile:
        from grpo_cli.rollout.hf import require_compilable

        require_compilable(policy)
    dtype = cfg.rollout.dtype
    if dtype == "auto" or getattr(torch, dtype) == next(policy.parameters()).dtype:
        return HFEngine(policy, eos_token_ids=ctx.eos_token_ids, pad_token_id=ctx.pad_token_id,
                        shares_policy_weights=True, compile_step=cfg.rollout.compile)
    import copy

    copy_model = copy.deepcopy(policy)
    if hasattr(copy_model, "merge_and_unload"):  # LoRA: the engine holds merged weights under checkpoint names
        copy_model = copy_model.merge_and_unload()
    copy_model = copy_model.to(getattr(torch, dtype)).eval()
    for p in copy_model.parameters():
        p.requires_grad_(False)
    return HFEngine(copy_model, eos_token_ids=ctx.eos_token_ids, pad_token_id=ctx.pad_token_id,
                    shares_policy_weights=False, compile_step=cfg.rollout.compile)
