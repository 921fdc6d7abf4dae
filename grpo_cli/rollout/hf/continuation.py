"""KV-cache continuation for multi-turn rollouts on the hf engine: a finished row's keys/values are kept, and the
next turn prefills only what follows them (its last sampled token, whose KV no step computed, and the
environment's tokens), instead of re-reading the prompt and every earlier turn.

Rows that leave a decode together are kept as they lie in its cache, with no copy of their slots (`KeptBatch`: the
cache's tensors cut at the last slot any of them used, and which slots are theirs). Layout of a continuation batch
of B rows, row j holding n_j cached tokens in a kept layout T_j slots wide and c_j new tokens (S₀ = max T_j,
E = max c_j): cache slots [0, T_j) hold row j's kept layout (its own tokens where its kept mask says, padding
between), slots [S₀ + E − c_j, S₀ + E) its new tokens (right-aligned, so the chunk's last position is every row's
last token), the rest is padding (mask 0); generation starts at slot S₀ + E. Positions stay the row's own: a new
token i sits at n_j + i, as in one rendering of the whole sequence (`decode`: position = cumsum(mask) − 1); the kept
keys carry their own positions' rotation, so where a slot sits does not matter, only the mask. The price is width
and memory: the padding of earlier turns (left-padded prompts, shorter chunks, rows that stopped before their
batch's longest) stays in the layout, masked, and a turn's cache tensors stay alive until the next turn has copied
them into its own (two caches at once, where a compacting copy held one cache and the rows' slots). A continuation seeds its cache from whole batches (one row selection per batch and
layer, one reordering when rows come from several), not row by row."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KeptBatch:
    """Rows that left a decode together: per layer (rows, heads, T, head_dim) keys and values as their cache held
    them, and `mask` (rows, T), 1 on each row's own slots (prompt or earlier turns, then its generated tokens but
    the last)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor


@dataclass
class RowKV:
    """One row's cached keys/values (row `index` of `batch`: `length` tokens, all but the last sampled one,
    `last_token`, which is fed first in the next turn)."""

    batch: KeptBatch
    index: int
    length: int
    last_token: int


def continuable(cache) -> bool:
    """Whether every layer of `cache` is a plain full-attention layer (static or growing) whose slots can be kept
    and re-seeded; sliding-window and hybrid layers are not."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    return all(type(layer) in (StaticLayer, DynamicLayer) for layer in cache.layers)


def stash_rows(cache, rows: list[int], mask: torch.Tensor, width: int, lengths: list[int],
               last_tokens: list[int]) -> list[RowKV]:
    """Keep batch rows `rows` (generated `lengths` tokens each) as one `KeptBatch`: their slots are the mask's
    ones before `width` (prompt, or kept history and new tokens), then generated slots [width, width + length − 1)
    (the last sampled token has no KV yet). The cache's tensors are cut, not copied, when `rows` are all its rows
    in order (the end of a decode); otherwise their rows are selected."""
    device = mask.device
    which = torch.as_tensor(rows, dtype=torch.long, device=device)
    n = torch.as_tensor(lengths, dtype=torch.long, device=device)
    total = width + int(n.max()) - 1
    whole = len(rows) == mask.shape[0] and rows == list(range(len(rows)))
    mine = mask[:, :total] if whole else mask.index_select(0, which)[:, :total]
    kept = mine.clone()
    kept[:, width:] = (torch.arange(total - width, device=device)[None, :] < (n - 1)[:, None]).to(kept.dtype)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[: len(rows), :, :total] if whole else t.index_select(0, which)[:, :, :total]  # rows past: padding

    batch = KeptBatch([cut(layer.keys) for layer in cache.layers], [cut(layer.values) for layer in cache.layers],
                      kept)
    counts = kept.sum(1).tolist()
    return [RowKV(batch, i, int(c), int(last)) for i, (c, last) in enumerate(zip(counts, last_tokens, strict=True))]


class KeptRows:
    """The kept rows of a continuation (`kept`, in its row order) grouped by batch: one row selection per batch,
    their order restored; `width` = S₀, the widest kept layout."""

    def __init__(self, kept: list[RowKV]) -> None:
        groups: dict[int, tuple[KeptBatch, list[int], list[int]]] = {}
        for j, row in enumerate(kept):
            group = groups.setdefault(id(row.batch), (row.batch, [], []))
            group[1].append(row.index)
            group[2].append(j)
        device = kept[0].batch.mask.device
        self.parts = [(batch, torch.tensor(rows, device=device)) for batch, rows, _ in groups.values()]
        order = [j for *_, js in groups.values() for j in js]
        self.inverse = None if order == sorted(order) else torch.argsort(torch.tensor(order, device=device))
        self.width = max(batch.mask.shape[1] for batch, _ in self.parts)

    def rows(self, pick) -> torch.Tensor:
        """`pick(batch)` (a tensor with rows first and slots third, or a mask with slots second) of every kept row,
        padded to `width` slots with zeros, in the continuation's row order."""
        pieces = []
        for batch, rows in self.parts:
            t = pick(batch).index_select(0, rows)
            dim = 1 if t.dim() == 2 else 2
            if t.shape[dim] < self.width:
                pad = [0, 0] * (t.dim() - 1 - dim) + [0, self.width - t.shape[dim]]
                t = torch.nn.functional.pad(t, pad)
            pieces.append(t)
        full = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return full if self.inverse is None else full.index_select(0, self.inverse)


def seed_cache(cache, kept: KeptRows) -> None:
    """Write the kept rows' layouts into slots [0, S₀ = `kept.width`) of a new `cache` (its next write goes to slot
    S₀)."""
    for layer in range(len(kept.parts[0][0].keys)):
        cache.update(kept.rows(lambda b: b.keys[layer]), kept.rows(lambda b: b.values[layer]), layer)


def chunk_inputs(kept: list[RowKV], layout: KeptRows, new_ids: list[list[int]], steps: int, pad_token_id: int,
                 device):
    """(ids (B, E), positions (B, E), mask (B, S₀ + E + steps), S₀) of the continuation chunk: row j's chunk is
    its last sampled token then `new_ids[j]`, right-aligned; the mask opens the kept slots (`layout`'s masks), the
    chunk's real tokens and every generated slot."""
    chunks = [[row.last_token, *ids] for row, ids in zip(kept, new_ids, strict=True)]
    kept_mask = layout.rows(lambda b: b.mask)
    s0, e = layout.width, max(map(len, chunks))
    ids = torch.tensor([[pad_token_id] * (e - len(c)) + c for c in chunks], dtype=torch.long)
    pos = torch.tensor([[0] * (e - len(c)) + list(range(row.length, row.length + len(c)))
                        for row, c in zip(kept, chunks, strict=True)], dtype=torch.long)
    start = e - torch.tensor([len(c) for c in chunks])[:, None]
    chunk = (torch.arange(e)[None, :] >= start).long()
    mask = torch.cat([kept_mask.long().cpu(), chunk, torch.ones((len(kept), steps), dtype=torch.long)], dim=1)
    return ids.to(device), pos.to(device), mask.to(device), s0
