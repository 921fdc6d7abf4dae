"""Sequence-parallel attention (`distributed.sequence_parallel`; `grpo_sdpa` calls it when its mask carries a
`ShardedRow`): each rank holds a contiguous shard of a packed row's positions; Ulysses swaps sequence shards for head
shards around the attention (all-to-all), ring passes key/value blocks around the group (`ring_attention`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F



@dataclass(frozen=True)
class SequenceShard:
    """One rank's place in its sequence-parallel group: `group` (a torch.distributed process group of `size`
    consecutive ranks), this rank's index in it, and the attention `style` (`ulysses` | `ring`)."""

    group: object
    size: int
    rank: int
    style: str
    global_ranks: tuple[int, ...] = field(default=())
    """The group's global ranks in group order (ring's send/recv peers)."""


KEEP = 1 << 28
"""Mask elements (bool: 256 MiB) a forward keeps for its layers; past it each layer builds its own."""


@dataclass
class ShardedRow:
    """What the attention of one sharded forward needs: the shard, for Ulysses the whole row's `grpo_sdpa` mask
    (`full_mask`, carrying the `packed_attention` layout) when that is cheaper than `causal_chunks`, and the packed
    row's per-position descriptors (R, N): `block` (its prompt group), `segment` (0 prompt, k completion k, −1
    padding) and `valid`, from which ring and `causal_chunks` build each block's mask."""

    shard: SequenceShard
    full_mask: torch.Tensor | None
    block: torch.Tensor
    segment: torch.Tensor
    valid: torch.Tensor
    causal: bool = False
    """The row is one sequence with no hole, then padding: its mask is plain causal (SDPA's `is_causal`)."""
    masks: dict = field(default_factory=dict)
    """`span`'s masks kept for the next layers (and the backward's recompute): every layer's are the same."""

    def allowed(self, q_block: int, k_block: int, rows: slice, keys: int) -> torch.Tensor:
        """(R, 1, len(rows), keys) bool: query positions `rows` of shard `q_block` may attend to the first `keys`
        key positions of shard `k_block` (`span`)."""
        n = self.block.shape[1] // self.shard.size
        return self.span(slice(q_block * n + rows.start, q_block * n + rows.stop),
                         slice(k_block * n, k_block * n + keys))

    def span(self, q: slice, k: slice) -> torch.Tensor:
        """(R, 1, len(q), len(k)) bool: row positions `q` may attend to row positions `k` (k ≤ q in the packed row,
        same prompt group, on the prompt or in q's own completion, a real token; every position also sees itself) —
        the mask `models.packing.packed_mask` / `packed_attention` apply. Kept while all kept masks hold at most
        `KEEP` elements."""
        key = (q.start, q.stop, k.start, k.stop)
        if key in self.masks:
            return self.masks[key]
        mask = self._span(q, k)
        if sum(m.numel() for m in self.masks.values()) + mask.numel() <= KEEP:
            self.masks[key] = mask
        return mask

    def _span(self, q: slice, k: slice) -> torch.Tensor:
        qi = torch.arange(q.start, q.stop, device=self.block.device)
        ki = torch.arange(k.start, k.stop, device=self.block.device)
        seg_q, seg_k = self.segment[:, q, None], self.segment[:, None, k]
        ok = ((ki[None, None, :] <= qi[None, :, None]) & (self.block[:, q, None] == self.block[:, None, k])
              & ((seg_k == 0) | (seg_k == seg_q)) & self.valid[:, None, k].bool())
        return (ok | (ki[None, None, :] == qi[None, :, None]))[:, None]


MASK = 1 << 24
"""Mask elements one query chunk of `causal_chunks` builds at a time (16 Mi: 16 MiB as bool)."""


def _chunk_attention(q, k, v, row: ShardedRow, start: int, scale: float | None) -> torch.Tensor:
    mask = row.span(slice(start, start + q.shape[2]), slice(0, k.shape[2]))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def causal_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: ShardedRow, *,
                  scale: float | None) -> torch.Tensor:
    """Attention (R, N, h, D) of the whole row (q (R, h, N, D), k/v (R, kv, N, D)) a chunk of queries at a time,
    each over the keys up to its last query (the mask is causal in the packed row): no N × N mask is built, and
    with autograd each chunk is recomputed in the backward rather than its mask kept (`torch.utils.checkpoint`)."""
    from torch.utils.checkpoint import checkpoint

    n = q.shape[2]
    step = max(1, MASK // max(1, q.shape[0] * n))
    outs = []
    for a in range(0, n, step):
        b = min(a + step, n)
        args = (q[:, :, a:b], k[:, :, :b], v[:, :, :b], row, a, scale)
        outs.append(checkpoint(_chunk_attention, *args, use_reentrant=False) if torch.is_grad_enabled()
                    else _chunk_attention(*args))
    return torch.cat(outs, dim=2).transpose(1, 2)


class _Groups:
    """`module` as the inner attention sees it after K/V heads were repeated to one per query head."""

    def __init__(self, module) -> None:
        self._module = module
        self.num_key_value_groups = 1

    def __getattr__(self, name):
        return getattr(self._module, name)


def _seq_to_heads(t: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """(R, H, n, D) local positions of every head → (R, H/size, N, D) every position of this rank's heads."""
    from torch.distributed.nn.functional import all_to_all

    parts = [c.contiguous() for c in t.chunk(shard.size, dim=1)]
    got = all_to_all([torch.empty_like(parts[0]) for _ in parts], parts, group=shard.group)
    return torch.cat(got, dim=2)


def _heads_to_seq(t: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """(R, N, H/size, D) every position of this rank's heads → (R, n, H, D) local positions of every head."""
    from torch.distributed.nn.functional import all_to_all

    parts = [c.contiguous() for c in t.chunk(shard.size, dim=1)]
    got = all_to_all([torch.empty_like(parts[0]) for _ in parts], parts, group=shard.group)
    return torch.cat(got, dim=2)


def ulysses_attention(inner, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row: ShardedRow,
                      *, scaling: float | None) -> torch.Tensor:
    """`inner` (the unsharded attention, `grpo_sdpa`) over the whole row for heads/size heads: the shards' queries,
    keys and values are swapped for head shards, and its output back. K/V heads that do not split `size` ways are
    repeated to one per query head first (each rank then holds the K/V of its own query heads)."""
    shard = row.shard
    heads, kv = query.shape[1], key.shape[1]
    if kv % shard.size:
        key, value = (t.repeat_interleave(heads // kv, dim=1) for t in (key, value))
        module = _Groups(module)
    q, k, v = (_seq_to_heads(t, shard) for t in (query, key, value))
    if row.full_mask is not None:
        out, _ = inner(module, q, k, v, row.full_mask, scaling=scaling)
    elif row.causal:  # the padding after the sequence sees it too; its outputs predict nothing
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)
    else:
        out = causal_chunks(q, k, v, row, scale=scaling)
    return _heads_to_seq(out.contiguous(), shard)


def sharded_attention(inner, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row: ShardedRow,
                      *, scaling: float | None, dropout: float) -> tuple[torch.Tensor, None]:
    """Attention output (R, n, H, D) of this rank's n positions, as `grpo_sdpa` returns it."""
    if dropout > 0.0:
        raise RuntimeError("sequence-parallel attention runs without dropout (model.attention_dropout must be 0)")
    if row.shard.style == "ulysses":
        return ulysses_attention(inner, module, query, key, value, row, scaling=scaling), None
    from grpo_cli.models.ring_attention import ring_attention

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return ring_attention(query, key, value, row, scale=scale).transpose(1, 2), None
