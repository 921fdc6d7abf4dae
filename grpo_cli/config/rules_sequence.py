"""Cross-field rules of `distributed.sequence_parallel`: what the sequence-sharded training path (ddp and fsdp2,
Ulysses or ring) cannot reproduce exactly is refused, each failure naming the field and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_cli.config.sections import GRPOSections as GRPOConfig

FIELD = "distributed.sequence_parallel.size"


def _heads(name: str) -> int | None:
    """The attention head count in a local checkpoint's config.json (None when it is not a local folder)."""
    from grpo_cli.config.model_shape import local_model_config

    c = local_model_config(name)
    return None if c is None else c.get("num_attention_heads")


def check_sequence_parallel(cfg: GRPOConfig) -> None:
    """Sequence parallelism runs on ddp and fsdp2 with `grpo_sdpa` attention, text rows, no distillation teacher, a
    size that divides the processes and (Ulysses) the attention heads."""
    d, sp = cfg.distributed, cfg.distributed.sequence_parallel
    if sp.size == 1:
        return
    world = d.num_processes * d.num_machines
    if world % sp.size:
        raise ValueError(
            f"{FIELD}={sp.size} must divide the {world} training processes (distributed.num_processes × "
            f"num_machines): the world is data parallel × sequence parallel. Run --nproc as a multiple of {sp.size} "
            "or pick a size that divides it.")
    if d.backend not in ("ddp", "fsdp2"):
        hint = (" (megatron shards sequences with its own context parallelism: distributed.megatron."
                "context_parallel_size)") if d.backend == "megatron" else ""
        raise ValueError(
            f"{FIELD}={sp.size} runs on distributed.backend ddp or fsdp2, not '{d.backend}'{hint}; set "
            "distributed.backend=fsdp2 (or ddp), or the size to 1.")
    if cfg.model.attn_implementation != "sdpa":
        raise ValueError(
            f"{FIELD}={sp.size} hooks the sharded attention into grpo-cli's sdpa attention, but "
            f"model.attn_implementation is '{cfg.model.attn_implementation}'; set model.attn_implementation=sdpa.")
    from grpo_cli.config.model_shape import is_vision_model

    if is_vision_model(cfg.model.name_or_path):
        raise ValueError(
            f"{FIELD}={sp.size}: {cfg.model.name_or_path} is a vision-language model, whose image tokens are "
            "placed by M-RoPE positions and the vision tower's outputs, which the position shards do not split "
            "safely; train it with the size at 1.")
    if cfg.algorithm.distill is not None:
        raise ValueError(
            f"{FIELD}={sp.size} does not shard the distillation teacher's pass yet; remove algorithm.distill or set "
            "the size to 1.")
    heads = _heads(cfg.model.name_or_path)
    if sp.style == "ulysses" and heads is not None and heads % sp.size:
        raise ValueError(
            f"{FIELD}={sp.size} with distributed.sequence_parallel.style=ulysses splits the {heads} attention heads "
            f"of {cfg.model.name_or_path} over the group, so the size must divide them (valid: "
            f"{[k for k in range(2, heads + 1) if heads % k == 0]}); pick one of those or set style=ring.")
