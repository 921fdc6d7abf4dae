"""Build the rollout engine named by the config, from its row of the (engine, mode) table
(`config/engine_modes.py`); heavy clients are imported only when their row is chosen."""

from __future__ import annotations

import importlib
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


def make_engine(cfg: GRPOConfig, ctx: EngineContext, *, policy=None, device=None, broadcast=None,
                wrap=None) -> RolloutEngine:
    """Build the engine for `cfg.rollout` (engine × mode): the builder its row of `config/engine_modes.MODES` names,
    imported here (heavy clients load only when chosen), given the extras the row asks for: `policy`, the trainer's
    Hugging Face model (hf engine; None: the engine loads its own copy of `ctx.model_path` onto `device`);
    `broadcast(obj)` shares rank 0's Ray address with the other ranks (async mode); `wrap(engine, cfg, tokenizer)`
    puts the caller's multi-turn or custom loop around each Ray actor's engine (async mode; rollout/ never imports
    agent/, the caller hands the loop down)."""
    row = cfg.rollout.layout
    extras = {"policy": policy, "device": device, "broadcast": broadcast, "wrap": wrap}
    return resolve(row.build)(cfg, ctx, **{name: extras[name] for name in row.build_args})


def resolve(where: str):
    """The function a row names (`module:attr[.attr]`, e.g. `EngineMode.build`), its module imported now."""
    module, _, path = where.partition(":")
    fn = importlib.import_module(module)
    for attr in path.split("."):
        fn = getattr(fn, attr)
    return fn


def make_hf_engine(cfg: GRPOConfig, ctx: EngineContext, *, policy, device=None) -> RolloutEngine:
    """The hf engine shares the policy's weights unless `rollout.dtype` asks for a copy in another dtype, or there
    is no Hugging Face policy to share (`policy` None: megatron trains Megatron-core chunks), in which case it loads
    its own copy of the checkpoint; weight sync keeps a copy up to date."""
    import torch

    from grpo_cli.rollout.hf.engine import HFEngine, image_processor

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
                    shares_policy_weights=shares, compile_step=cfg.rollout.compile, images=image_processor(cfg, ctx),
                    rank=ctx.rank)


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
