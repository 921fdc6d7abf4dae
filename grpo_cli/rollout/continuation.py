"""KV-cache continuation for multi-turn rollouts on the hf engine: a finished row's keys/values are kept, and the
next turn prefills only what follows them (its last sampled token, whose KV no step computed, and the
environment's tokens), instead of re-reading the prompt and every earlier turn.

Layout of a continuation batch of B rows, row j holding n_j cached tokens and c_j new ones (S₀ = max n_j,
E = max c_j): cache slots [S₀ − n_j, S₀) hold row j's kept KV (right-aligned), slots [S₀ + E − c_j, S₀ + E) its
new tokens (right-aligned, so the chunk's last position is every row's last token), the rest is padding (mask 0);
generation starts at slot S₀ + E. Positions stay the row's own: a new token i sits at n_j + i, as in one
rendering of the whole sequence (`decode`: position = cumsum(mask) − 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowKV:
    """One row's cached keys/values, per layer (heads, n, head_dim), for its tokens but the last sampled one
    (`last_token`), which is fed first in the next turn."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_token: int

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1])


def continuable(cache) -> bool:
    """Whether every layer of `cache` is a plain full-attention layer (static or growing) whose slots can be kept
    and re-seeded; sliding-window and hybrid layers are not."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    return all(type(layer) in (StaticLayer, DynamicLayer) for layer in cache.layers)


def stash_rows(cache, rows: list[int], mask: torch.Tensor, width: int, lengths: list[int],
               last_tokens: list[int]) -> list[RowKV]:
    """The KV of batch rows `rows` over their valid slots: the mask's ones before `width` (prompt, or kept history
    and new tokens), then generated slots [width, width + length − 1) (the last sampled token has no KV yet)."""
    out = []
    for r, n, last in zip(rows, lengths, last_tokens, strict=True):
        slots = torch.cat([mask[r, :width].nonzero().squeeze(1),
                           torch.arange(width, width + n - 1, device=mask.device)])
        out.append(RowKV([layer.keys[r].index_select(1, slots) for layer in cache.layers],
                         [layer.values[r].index_select(1, slots) for layer in cache.layers], int(last)))
    return out


def seed_cache(cache, kept: list[RowKV], width: int) -> None:
    """Write each row's kept KV right-aligned into slots [width − n_j, width) of a new `cache` (zeros elsewhere);
    the cache's next write goes to slot `width`."""
    for index in range(len(kept[0].keys)):
        k0, v0 = kept[0].keys[index], kept[0].values[index]
        keys = k0.new_zeros((len(kept), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(kept), v0.shape[0], width, v0.shape[2]))
        for j, row in enumerate(kept):
            keys[j, :, width - row.length:] = row.keys[index]
            values[j, :, width - row.length:] = row.values[index]
        cache.update(keys, values, index)


def chunk_inputs(kept: list[RowKV], new_ids: list[list[int]], steps: int, pad_token_id: int, device):
    """(ids (B, E), positions (B, E), mask (B, S₀ + E + steps), S₀) of the continuation chunk: row j's chunk is
    its last sampled token then `new_ids[j]`, right-aligned; the mask opens the kept slots, the chunk's real
    tokens and every generated slot."""
    chunks = [[row.last_token, *ids] for row, ids in zip(kept, new_ids, strict=True)]
    s0, e = max(row.length for row in kept), max(map(len, chunks))
    ids = torch.full((len(kept), e), pad_token_id, dtype=torch.long)
    pos = torch.zeros((len(kept), e), dtype=torch.long)
    mask = torch.zeros((len(kept), s0 + e + steps), dtype=torch.long)
    mask[:, s0 + e:] = 1
    for j, (row, chunk) in enumerate(zip(kept, chunks, strict=True)):
        c = len(chunk)
        ids[j, e - c:] = torch.tensor(chunk, dtype=torch.long)
        pos[j, e - c:] = torch.arange(row.length, row.length + c)
        mask[j, s0 - row.length: s0] = 1
        mask[j, s0 + e - c: s0 + e] = 1
    return ids.to(device), pos.to(device), mask.to(device), s0
