"""Completion logprobs and entropy of a micro-batch whose packed row is cut across a sequence-parallel group.

The micro-batch is packed as one row (`models.packing`: each prompt once, then its completions), padded to a
multiple of the group size and cut into `size` contiguous shards of positions; each rank embeds its shard (position
ids stay the row's own, for RoPE), its attention reaches the other shards (`sequence_attention`), and its output
layer runs on its own positions only (`_HeadStats`: the logits are never whole on any rank). Each rank's (B, T)
values, zero where another rank computed them, are summed over the group (with autograd), so every rank holds the
whole micro-batch's logprobs and entropy and computes the same loss as one unsharded forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from grpo_cli.models.attention import LAYOUT_ATTR, SHARD_ATTR
from grpo_cli.models.packing import Packing, plan_packing
from grpo_cli.models.sequence_attention import SequenceShard, ShardedRow
from grpo_cli.models.vocab_parallel import VocabRows


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
    the same on every rank of the group; 0 where a completion slot is past its row's end. The embedding and output
    layer run vocabulary-parallel (`vocab_parallel`) when FSDP2 shards them over exactly this group, else on the
    whole weight (each rank's output layer on its own positions, the results summed over the group)."""
    from grpo_cli.models.packing import completion_widths
    from grpo_cli.models.vocab_parallel import parallel_embedding, parallel_head

    batch, width = input_ids.shape
    prompt_len = width - logits_to_keep
    packing = padded_packing(plan_packing(input_ids, attention_mask, prompt_len, max_row=None), shard.size)
    src = packing.src.clamp(min=0)
    valid = attention_mask.reshape(-1)[src] * (packing.src >= 0)
    n = packing.src.shape[1] // shard.size
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0).reshape(-1)[src]
    mask = torch.ones((), dtype=torch.bool, device=src.device).expand(src.shape[0], 1, n, n)
    setattr(mask, SHARD_ATTR, _sharded_row(packing, valid, shard))
    cut = _Cut(input_ids.reshape(-1)[src], position_ids[:, shard.rank * n : (shard.rank + 1) * n], mask,
               input_ids[:, prompt_len:], (batch, logits_to_keep))
    slots = [_local_slots(packing, completion_widths(attention_mask[:, prompt_len:]), r * n, (r + 1) * n)
             for r in range(shard.size)]
    options = {"temperature": temperature, "with_entropy": with_entropy, "entropy_grad": entropy_grad}
    hf = getattr(model, "module", model)
    embedding = parallel_embedding(hf.get_input_embeddings(), shard)
    rows = parallel_head(hf.get_output_embeddings(), shard)
    if embedding is not None and rows is not None:
        return _vocab_parallel(model, cut, slots, embedding, rows, shard, **options)
    return _own_positions(model, cut, slots[shard.rank], shard, **options)


@dataclass(frozen=True)
class _Cut:
    """One micro-batch's packed row as every rank of the group sees it: the row's ids (R, N), this rank's position ids
    and attention mask, the completion tokens (B, T) and the (B, T) shape of the result."""

    ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    shape: tuple[int, int]

    def own_ids(self, shard: SequenceShard) -> torch.Tensor:
        n = self.ids.shape[1] // shard.size
        return self.ids[:, shard.rank * n : (shard.rank + 1) * n]

    def scatter(self, out: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(B, T, k) with `out`'s (m, k) rows at slots (b, t), 0 elsewhere."""
        return out.new_zeros(*self.shape, out.shape[-1]).index_put((b, t), out)


def _own_positions(model, cut: _Cut, slots, shard: SequenceShard, *, temperature: float, with_entropy: bool,
                   entropy_grad: bool) -> torch.Tensor:
    """`sharded_stats` with the whole output weight on every rank (`_HeadStats`: FSDP2 gathers it, DDP replicates
    it): each rank's head runs on the positions of its shard, and the (B, T, k) parts are summed over the group."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_reduce

    from grpo_cli.models.logprobs import _HeadStats

    b, t, at = slots
    empty = b.numel() == 0  # no token of this shard predicts one: the head still runs (on position 0, weight 0)
    keep, index = torch.unique(at.new_zeros(1) if empty else at, return_inverse=True)
    targets = cut.targets[b, t] if not empty else cut.targets.new_zeros(1)
    head = _HeadStats.install(model, targets[None], temperature=temperature, with_entropy=with_entropy,
                              entropy_grad=entropy_grad)
    if head is None:
        raise RuntimeError("distributed.sequence_parallel needs the chunked output layer; this model transforms "
                           "its logits after it (config/rules_sequence.py refuses such models)")
    head.select = lambda hidden: hidden[:, index]
    with head:
        out = model(input_ids=cut.own_ids(shard), attention_mask=cut.mask, position_ids=cut.position_ids,
                    use_cache=False, logits_to_keep=keep).logits
    if head.result is None or out.shape != head.result.shape:
        raise RuntimeError("the model changed its output layer's result; sequence parallelism cannot use it")
    part = _scattered(cut, out, b, t, empty)
    if torch.is_grad_enabled():
        return all_reduce(part, group=shard.group)
    dist.all_reduce(part, group=shard.group)
    return part


def _vocab_parallel(model, cut: _Cut, slots, embedding: VocabRows, rows: VocabRows, shard: SequenceShard, *,
                    temperature: float, with_entropy: bool, entropy_grad: bool) -> torch.Tensor:
    """`sharded_stats` on vocabulary-parallel weights (`vocab_parallel`): this rank's embeddings from its rows of the
    embedding (the model gets `inputs_embeds`), and in the output layer's place a `DetachedHead` that gathers the
    group's hidden states at every position predicting a completion token and projects them onto this rank's rows
    (`chunked_logprobs` with a `VocabShard`): every rank computes the whole (B, T, k), no sum afterwards. A chunk
    holds as many positions as the whole vocabulary's would (`chunk_rows(V)`), so each rank's (n, V/size) logits
    buffers are 1/size of the unsharded head's. With no completion token in the micro-batch, every rank projects its
    first position (target 0) and the result is 0."""
    from grpo_cli.algo.chunk_size import chunk_rows
    from grpo_cli.algo.chunked_logprobs import VocabShard, chunked_logprobs
    from grpo_cli.models.vocab_parallel import DetachedHead, embed_positions, gather_rows, group_reduce, swapped

    hf = getattr(model, "module", model)
    counts = [s[0].numel() for s in slots]
    empty = sum(counts) == 0
    b, t = torch.cat([s[0] for s in slots]), torch.cat([s[1] for s in slots])
    at = slots[shard.rank][2]
    keep, index = torch.unique(at if at.numel() else at.new_zeros(1), return_inverse=True)
    targets = cut.targets[b, t] if not empty else cut.targets.new_zeros(shard.size)
    counts = [1] * shard.size if empty else counts
    vocab_shard = VocabShard(rows.start, rows.vocab, group_reduce(shard))

    def project(hidden: torch.Tensor) -> torch.Tensor:
        mine = hidden[0, index[: counts[shard.rank]]]  # none when this shard predicts no token (its stand-in 0)
        every = gather_rows(mine, counts, shard)
        logprob, entropy = chunked_logprobs(
            every, targets.to(every.device), project=None, weight=rows.local, temperature=temperature,
            chunk=chunk_rows(rows.vocab, device=every.device.type), with_entropy=with_entropy,
            entropy_grad=entropy_grad, shard=vocab_shard)
        return torch.stack([logprob] if entropy is None else [logprob, entropy], dim=-1)[None]

    inputs = embed_positions(hf.get_input_embeddings(), embedding, cut.ids, shard)
    with swapped(hf, hf.get_output_embeddings(), DetachedHead(project)):
        out = model(inputs_embeds=inputs, attention_mask=cut.mask, position_ids=cut.position_ids, use_cache=False,
                    logits_to_keep=keep).logits
    return _scattered(cut, out, b, t, empty)


def _scattered(cut: _Cut, out: torch.Tensor, b: torch.Tensor, t: torch.Tensor, empty: bool) -> torch.Tensor:
    """(B, T, k): the head's (1, m, k) result `out` at slots (b, t); with `empty` (its one row stood in for no token)
    zeros, still on `out`'s graph (so every parameter gets its gradient, 0, on every rank)."""
    if empty:
        return cut.scatter(out[0, :0], b, t) + out.sum() * 0.0
    return cut.scatter(out[0], b, t)


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
