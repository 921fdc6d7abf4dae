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


def make_engine(cfg: GRPOConfig, ctx: EngineContext, *, policy=None, device=None, broadcast=None) -> RolloutEngine:
    """Build the engine for `cfg.rollout` (engine × mode). `policy` is the trainer's Hugging Face model (hf engine;
    None: the engine loads its own copy of `ctx.model_path` onto `device`); `broadcast(obj)` shares rank 0's Ray
    address with the other ranks (async mode)."""
    r = cfg.rollout
    if r.mode == "async":
        from grpo_cli.rollout.ray.engine import AsyncRolloutEngine

        return AsyncRolloutEngine.from_config(cfg, ctx, broadcast=broadcast)
    if r.mode == "server":
        if r.engine == "sglang":
            from grpo_cli.rollout.sglang.client import SGLangEngine

            return SGLangEngine.from_config(cfg, ctx)
        if r.engine == "vllm-serve":
            from grpo_cli.rollout.vllm_serve.client import VLLMServeEngine

            return VLLMServeEngine.from_config(cfg, ctx)
        from grpo_cli.rollout.remote.client import ServerEngine

        return ServerEngine.from_config(cfg, ctx)
    if r.engine == "vllm":
        from grpo_cli.rollout.vllm.engine import VLLMEngine

        return VLLMEngine.from_config(cfg, ctx)
    return make_hf_engine(cfg, ctx, policy=policy, device=device)


def make_hf_engine(cfg: GRPOConfig, ctx: EngineContext, *, policy, device=None) -> RolloutEngine:
    """The hf engine shares the policy's weights unless `rollout.dtype` asks for a copy in another dtype, or there
    is no Hugging Face policy to share (`policy` None: megatron trains Megatron-core chunks), in which case it loads
    its own copy of the checkpoint; weight sync keeps a copy up to date."""
    import torch

    from grpo_cli.rollout.hf.engine import HFEngine

    if policy is None:
        from grpo_cli.rollout.hf.generation_copy import hf_copy_engine

        return hf_copy_engine(cfg, ctx, device=device)
    if cfg.rollout.compile:
        from grpo_cli.rollout.hf.engine import require_compilable

        require_compilable(policy)
    dtype = cfg.rollout.dtype
    shares = dtype == "auto" or getattr(torch, dtype) == next(policy.parameters()).dtype
    model = policy if shares else _frozen_copy(policy, getattr(torch, dtype))
    return HFEngine(model, eos_token_ids=ctx.eos_token_ids, pad_token_id=ctx.pad_token_id,
                    shares_policy_weights=shares, compile_step=cfg.rollout.compile)


def _frozen_copy(policy, dtype):
    """The policy copied into `dtype`, frozen; LoRA merged, so the engine holds its weights under checkpoint names."""
    import copy

    model = copy.deepcopy(policy)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model = model.to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
