"""Completion logprobs and entropy of a micro-batch whose packed row is cut across a sequence-parallel group.

The micro-batch is packed as one row (`models.packing`: each prompt once, then its completions), padded to a
multiple of the group size and cut into `size` contiguous shards of positions; each rank embeds its shard (position
ids stay the row's own, for RoPE), its attention reaches the other shards (`sequence_attention`), and its output
layer runs on its own positions only (`_HeadStats`: the logits are never whole on any rank). Each rank's (B, T)
values, zero where another rank computed them, are summed over the group (with autograd), so every rank holds the
whole micro-batch's logprobs and entropy and computes the same loss as one unsharded forward.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from grpo_cli.models.attention import LAYOUT_ATTR, SHARD_ATTR
from grpo_cli.models.packing import Packing, plan_packing
from grpo_cli.models.sequence_attention import SequenceShard, ShardedRow


def padded_packing(packing: Packing, size: int) -> Packing:
    """`packing` with its row width rounded up to a multiple of `size` (padding positions: src and segment −1)."""
    n = packing.src.shape[1]
    extra = -n % size
    if not extra:
        return packing
    pad = packing.src.new_full((packing.src.shape[0], extra), -1)
    return replace(packing, src=torch.cat([packing.src, pad], 1), segment=torch.cat([packing.segment, pad], 1))


def _blocks(segment: torch.Tensor) -> torch.Tensor:
    """(R, N) prompt group of each position: a group starts where a prompt (segment 0) follows a non-prompt."""
    prompt = segment == 0
    before = torch.cat([torch.zeros_like(prompt[:, :1]), prompt[:, :-1]], dim=1)
    return (prompt & ~before).long().cumsum(1)


def layout_pays(packing: Packing) -> bool:
    """Whether `packed_attention`'s layout (per sequence: its prompt's keys and its own, padded to the widest
    completion; its completion mask whole) scores fewer query × key pairs than `causal_chunks` over the whole row
    (N²/2). Many short completions: the layout; one long sequence: the chunks, whose masks are never whole."""
    rows, n = packing.src.shape
    p, widest = packing.prompt_len, int(packing.width.max()) if packing.width.numel() else 1
    blocks = int(torch.unique(packing.row * n + packing.prompt_start).numel())
    return blocks * p * p + packing.width.numel() * widest * (p + widest) < rows * n * n / 2


def _sharded_row(packing: Packing, valid: torch.Tensor, shard: SequenceShard) -> ShardedRow:
    full = None
    if shard.style == "ulysses" and layout_pays(packing):  # each rank runs the whole row's layout for its heads
        from grpo_cli.models.packed_attention import build_layout

        rows, n = packing.src.shape
        full = torch.ones((), dtype=torch.bool, device=valid.device).expand(rows, 1, n, n)
        setattr(full, LAYOUT_ATTR, build_layout(packing, valid))
    seg, real = packing.segment, int(valid.sum())
    causal = (seg.shape[0] == 1 and bool(valid[0, :real].all()) and int(seg.max()) <= 1
              and bool((seg[0, real:] < 0).all()))  # one sequence, no hole: then padding only
    return ShardedRow(shard, full, _blocks(seg), seg, valid, causal=causal)


def _local_slots(packing: Packing, width: torch.Tensor, lo: int, hi: int):
    """(b, t) of the completion tokens whose predicting position lies in [lo, hi), and that position minus lo."""
    steps = packing.pos.shape[1]
    slot = torch.arange(steps, device=width.device)[None, :] < width[:, None]
    mine = slot & (packing.pos >= lo) & (packing.pos < hi)
    b, t = mine.nonzero(as_tuple=True)
    return b, t, packing.pos[b, t] - lo


def sharded_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int,
                  temperature: float, with_entropy: bool, entropy_grad: bool, shard: SequenceShard):
    """(B, T, k) = logprob (and entropy) of the last T = logits_to_keep tokens of each row of `input_ids` (B, S),
    the same on every rank of the group; 0 where a completion slot is past its row's end."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_reduce

    from grpo_cli.models.logprobs import _HeadStats
    from grpo_cli.models.packing import completion_widths

    batch, width = input_ids.shape
    prompt_len = width - logits_to_keep
    packing = padded_packing(plan_packing(input_ids, attention_mask, prompt_len, max_row=None), shard.size)
    src = packing.src.clamp(min=0)
    valid = attention_mask.reshape(-1)[src] * (packing.src >= 0)
    n = packing.src.shape[1] // shard.size
    lo, hi = shard.rank * n, (shard.rank + 1) * n
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0).reshape(-1)[src]
    mask = torch.ones((), dtype=torch.bool, device=src.device).expand(src.shape[0], 1, n, n)
    setattr(mask, SHARD_ATTR, _sharded_row(packing, valid, shard))
    b, t, at = _local_slots(packing, completion_widths(attention_mask[:, prompt_len:]), lo, hi)
    empty = b.numel() == 0  # no token of this shard predicts one: the head still runs (on position 0, weight 0)
    keep, index = torch.unique(at.new_zeros(1) if empty else at, return_inverse=True)
    targets = input_ids[:, prompt_len:][b, t] if not empty else input_ids.new_zeros(1)
    head = _HeadStats.install(model, targets[None], temperature=temperature, with_entropy=with_entropy,
                              entropy_grad=entropy_grad)
    if head is None:
        raise RuntimeError("distributed.sequence_parallel needs the chunked output layer; this model transforms "
                           "its logits after it (config/rules_sequence.py refuses such models)")
    head.select = lambda hidden: hidden[:, index]
    with head:
        out = model(input_ids=input_ids.reshape(-1)[src][:, lo:hi], attention_mask=mask,
                    position_ids=position_ids[:, lo:hi], use_cache=False, logits_to_keep=keep).logits
    if head.result is None or out.shape != head.result.shape:
        raise RuntimeError("the model changed its output layer's result; sequence parallelism cannot use it")
    part = out.new_zeros(batch, logits_to_keep, out.shape[-1])
    part = part + out.sum() * 0.0 if empty else part.index_put((b, t), out[0])
    if torch.is_grad_enabled():
        return all_reduce(part, group=shard.group)
    dist.all_reduce(part, group=shard.group)
    return part


def sharded_logprobs_entropy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int,
                             temperature: float, with_entropy: bool, entropy_grad: bool,
                             shard: SequenceShard) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`models.logprobs.completion_logprobs_entropy` (or, without `with_entropy`, `completion_logprobs` and None)
    of a micro-batch cut across `shard`'s group: (B, T) each, equal on every rank of the group."""
    stats = sharded_stats(model, input_ids, attention_mask, logits_to_keep=logits_to_keep, temperature=temperature,
                          with_entropy=with_entropy, entropy_grad=entropy_grad, shard=shard)
    if not with_entropy:
        return stats[..., 0], None
    return stats[..., 0], stats[..., 1] if entropy_grad else stats[..., 1].detach()
