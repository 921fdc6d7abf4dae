"""`grpo plan`'s long-context rows: a sequence's positions split over the sequence-parallel ranks (fsdp2/ddp
`distributed.sequence_parallel`, megatron `context_parallel_size`) divide the activations and the head's logits chunk,
and the longest sequence that fits one GPU at each split."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.algo.chunk_size import chunk_bytes, split_chunk_bytes
from grpo_cli.config.hsdp import vocab_parallel
from grpo_cli.config.model_shape import QWEN_VOCAB, model_shape
from grpo_cli.planner.plan_megatron import megatron_activation_bytes
from grpo_cli.planner.plan_tokens import GRANULE, activation_bytes_per_position, micro_batch_positions

if TYPE_CHECKING:
    from collections.abc import Callable

    from grpo_cli.config.model_shape import ModelShape
    from grpo_cli.config.schema import GRPOConfig

SHARD_SIZES = (1, 2, 4, 8)
"""The split sizes `grpo plan` names the longest sequence for."""
LONGEST_CAP = 1 << 22
"""The longest sequence the search tries (4M positions): past it the row says `≥`."""


def sequence_shards(cfg: GRPOConfig) -> int:
    """Ranks one sequence's positions are split over: megatron's `context_parallel_size` on the megatron backend,
    `distributed.sequence_parallel.size` on the others."""
    d = cfg.distributed
    return d.megatron.context_parallel_size if d.backend == "megatron" else d.sequence_parallel.size


def _per_rank(positions: int, shards: int) -> int:
    """Positions of one rank: the micro-batch is padded to a multiple of `shards`, then cut into equal shards."""
    return -(-positions // shards)


def sharded_rows(cfg: GRPOConfig, shape: ModelShape, plan: dict[str, int], *, device: str,
                 shards: int | None = None, length: int | None = None) -> dict[str, float]:
    """The `activations` (and, off megatron, `head_chunk`) rows of one GPU when a micro-batch's positions are split
    over `shards` ranks (default: the config's), for sequences of `length` positions (default: the longest of the
    config). Off megatron a micro-batch holds the token budget's positions (the budget is per sequence-parallel
    group; for a given `length`, one packed sequence of it), else `micro_batch_size` rows padded to the length; each rank keeps 1/shards of them (rounded up), so the
    activations and the positions of a logits chunk divide by `shards` (under fsdp2's vocabulary-parallel head,
    `config.hsdp.vocab_parallel`, its columns do: every position, V/shards columns). On megatron the per-layer activations of
    `plan_megatron.megatron_activation_bytes` divide by cp (queries split, keys whole: the s² scores too), and the
    head chunk holds at most s·b/cp positions."""
    n = shards or sequence_shards(cfg)
    s = length or cfg.max_sequence_length
    if cfg.distributed.backend == "megatron":
        tp = cfg.distributed.megatron.tensor_parallel
        vocab = -(-(shape.vocab or QWEN_VOCAB) // tp)
        whole = s * cfg.train.micro_batch_size
        full = megatron_activation_bytes(cfg, shape, {**plan, "max_sequence_length": s}, device=device)
        layers = full - chunk_bytes(vocab, whole, device=device)
        return {"activations": layers / n + chunk_bytes(vocab, _per_rank(whole, n), device=device)}
    budget = cfg.train.micro_batch_tokens
    if length is None:
        positions = micro_batch_positions(cfg)
    else:
        positions = s if budget else cfg.train.micro_batch_size * s  # a budget set to that one packed sequence
    mine = _per_rank(positions, n)
    vocab = shape.vocab or QWEN_VOCAB
    if vocab_parallel(cfg, n):  # every position of the group, V/n columns (`models.vocab_parallel`)
        head = split_chunk_bytes(vocab, positions, n, device=device)
    else:
        head = chunk_bytes(vocab, mine, device=device)
    return {"activations": mine * activation_bytes_per_position(cfg, shape), "head_chunk": head}


def _refusal(cfg: GRPOConfig, shape: ModelShape, n: int) -> str | None:
    """Why a split of `n` ranks cannot run this config's grid (None when it can)."""
    d = cfg.distributed
    world = d.num_processes * d.num_machines
    if d.backend == "megatron":
        grid = d.megatron.tensor_parallel * d.megatron.pipeline_parallel * n
        return None if world % grid == 0 else f"tp x pp x {n} does not divide the {world} processes"
    if world % n:
        return f"does not divide the {world} processes"
    heads = shape.heads or max(1, shape.hidden // 128)
    if d.sequence_parallel.style == "ulysses" and heads % n:
        return f"ulysses: does not divide the {heads} attention heads (ring can)"
    return None


def longest_sequence(cfg: GRPOConfig, mem: dict[str, float], plan: dict[str, int], shards: int, limit: float, *,
                     device: str, peak: Callable[[GRPOConfig, dict[str, float]], float]) -> int:
    """The longest sequence (a multiple of `GRANULE` positions) whose micro-batch, split over `shards` ranks, keeps
    `peak(cfg, mem)` within `limit` with everything else of `mem` unchanged; 0 when not even `GRANULE` fits,
    `LONGEST_CAP` when that still fits."""
    shape = model_shape(cfg.model.name_or_path)

    def fits(length: int) -> bool:
        rows = sharded_rows(cfg, shape, plan, device=device, shards=shards, length=length)
        return peak(cfg, mem | rows) <= limit

    if not fits(GRANULE):
        return 0
    low, high = GRANULE, GRANULE
    while high < LONGEST_CAP and fits(high * 2):
        low = high = high * 2
    if high >= LONGEST_CAP:
        return LONGEST_CAP
    high *= 2
    while high - low > GRANULE:  # fits(low), not fits(high)
        mid = (low + high) // 2 // GRANULE * GRANULE
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def long_context_lines(cfg: GRPOConfig, mem: dict[str, float], plan: dict[str, int], limit: float | None, *,
                       device: str, peak: Callable[[GRPOConfig, dict[str, float]], float]) -> list[str]:
    """`grpo plan`'s long-context section: the configured split and, with `--gpu-mem` (`limit` = its usable share),
    the longest sequence one GPU fits at each split of `SHARD_SIZES` (in a micro-batch of `micro_batch_size` rows of
    it, or, under a token budget, a micro-batch of that one packed sequence). Shown when the config splits sequences
    or `limit` is given."""
    n, megatron = sequence_shards(cfg), cfg.distributed.backend == "megatron"
    if n == 1 and not limit:
        return []
    shape = model_shape(cfg.model.name_or_path)
    key = "cp" if megatron else "sp"
    what = (f"megatron context_parallel_size {n}" if megatron else
            f"sequence_parallel {n} ({cfg.distributed.sequence_parallel.style})")
    lines = [f"# long context ({what}: activations and the head's logits chunk per GPU ÷ {n})"]
    whole = micro_batch_positions(cfg) if not megatron else cfg.max_sequence_length * cfg.train.micro_batch_size
    lines.append(f"  {'positions_per_gpu':28s} {_per_rank(whole, n)} of the micro-batch's {whole}")
    if megatron and n > 1:
        lines.append(f"  {'note':28s} `grpo train` refuses context_parallel_size > 1 (megatron-core needs Transformer "
                     "Engine's attention for it; docs/megatron.md)")
    if not limit:
        return lines
    for size in SHARD_SIZES:
        why = _refusal(cfg, shape, size)
        found = longest_sequence(cfg, mem, plan, size, limit, device=device, peak=peak)
        text = "none (the rest of the GPU's memory is full)" if found == 0 else \
            (f">= {found}" if found >= LONGEST_CAP else f"{found}")
        mark = " (configured)" if size == n else ""
        lines.append(f"  {f'longest_sequence_{key}{size}':28s} {text}{mark}" + (f"   [{why}]" if why else ""))
    return lines
