"""Attention over shared-prompt packed rows without the row-wide N × N work.

A packed row is [prompt | c_1 | c_2 | …] (`models.packing`), or one row of every group in turn, [prompt₁ | its
completions | prompt₂ | …]; a completion token attends only to its prompt and to the earlier tokens of its own
completion. The dense 4D mask makes SDPA compute every row's N × N scores (N = prompt
+ all the group's completions) and throw most of them away. Here the same attention runs as two small batched
SDPA calls whose masked-out part is only padding:

- prompt queries, gathered per prompt block (P, H, p): causal over the block's own keys;
- completion queries, gathered per sequence (B, H, W) with W = the widest completion: keys = its prompt's keys
  followed by the sequence's own keys (B, KV, p + W), causal within the completion.

Each output position gets softmax(q·kᵀ·scale + mask)·v over exactly the keys the dense mask allows, so the values
equal the dense computation up to float rounding; work per completion token is p + W keys instead of N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_cli.models.packing import Packing


@dataclass
class PackedLayout:
    """Index bookkeeping of one packed batch (R rows of N positions, P prompt blocks of length p, B sequences,
    widest completion W). Flat indices address positions r·N + j."""

    rows: int
    n: int
    prompt_index: torch.Tensor
    """(P, p): flat positions of each prompt block."""
    query_index: torch.Tensor
    """(B, W): flat position of completion token i of sequence b (clamped into the row for i ≥ width)."""
    key_index: torch.Tensor
    """(B, p + W): the sequence's prompt positions, then `query_index`."""
    prompt_mask: torch.Tensor
    """(P, 1, p, p) additive float32 (0 kept, −inf not): causal over the block's valid keys, each position also sees
    itself."""
    completion_mask: torch.Tensor
    """(B, 1, W, p + W) additive float32: valid prompt keys, then causal over the sequence's own tokens (and
    itself). Additive rather than bool: SDPA's CPU kernel would convert a bool mask in every call, forward and
    backward, of every layer (~10% of its time here)."""
    out_index: torch.Tensor
    """(M,): flat positions of the M valid completion tokens, in (b, i) order."""
    out_select: torch.Tensor
    """(M,): their index into the (B·W) gathered completion queries."""


def _additive(keep: torch.Tensor) -> torch.Tensor:
    """0 where `keep`, −inf elsewhere, float32."""
    return torch.zeros(keep.shape, device=keep.device).masked_fill_(~keep, float("-inf"))


def build_layout(packing: Packing, valid: torch.Tensor) -> PackedLayout:
    """`valid` (R, N): 1 where the packed position holds an unmasked token."""
    rows, n = packing.src.shape
    p, device = packing.prompt_len, packing.src.device
    widths, starts, row = packing.width, packing.start, packing.row
    w = max(int(widths.max()), 1) if widths.numel() else 1
    i = torch.arange(w, device=device)
    offset = (starts[:, None] + i).clamp(max=n - 1)
    query_index = row[:, None] * n + offset
    block_starts, block = torch.unique(row * n + packing.prompt_start, return_inverse=True)
    prompt_index = block_starts[:, None] + torch.arange(p, device=device)  # (P, p)
    key_index = torch.cat([prompt_index[block], query_index], dim=1)
    prompt_valid = valid.bool().reshape(-1)[prompt_index]
    causal_p = torch.ones(p, p, dtype=torch.bool, device=device).tril()
    eye_p = torch.eye(p, dtype=torch.bool, device=device)
    prompt_mask = ((causal_p & prompt_valid[:, None, :]) | eye_p)[:, None]
    own = i[:, None] >= i[None, :]  # key j ≤ query i
    own_valid = i[None, :] < widths[:, None]  # (B, W) keys inside the completion
    completion_mask = torch.cat([
        prompt_valid[block][:, None, :].expand(-1, w, -1),
        (own[None] & own_valid[:, None, :]) | torch.eye(w, dtype=torch.bool, device=device)[None],
    ], dim=2)[:, None]
    take = (i[None, :] < widths[:, None]).reshape(-1)
    out_select = take.nonzero().squeeze(1)
    return PackedLayout(rows, n, prompt_index, query_index, key_index, _additive(prompt_mask),
                        _additive(completion_mask), query_index.reshape(-1)[out_select], out_select)


def _gather(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """flat[index] as `index_select` on dim 0: the same values, but its backward is an `index_add` (~2–7x faster on
    CPU here than the accumulating `index_put` that advanced indexing's backward runs)."""
    return flat.index_select(0, index.reshape(-1)).view(*index.shape, *flat.shape[1:])


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout, *,
                     scale: float | None, gqa: bool) -> torch.Tensor:
    """Attention output (R, N, H, D) for query (R, H, N, D), key/value (R, KV, N, D) of a packed batch."""
    rows, heads, n, dim = query.shape
    q_flat = query.transpose(1, 2).reshape(rows * n, heads, dim)
    k_flat = key.transpose(1, 2).reshape(rows * n, key.shape[1], dim)
    v_flat = value.transpose(1, 2).reshape(rows * n, value.shape[1], dim)
    prompt = layout.prompt_index
    prompt_out = F.scaled_dot_product_attention(
        *(_gather(flat, prompt).transpose(1, 2) for flat in (q_flat, k_flat, v_flat)),
        attn_mask=layout.prompt_mask.to(query.dtype), scale=scale, enable_gqa=gqa)  # (P, H, p, D)
    q = _gather(q_flat, layout.query_index).transpose(1, 2)  # (B, H, W, D)
    k = _gather(k_flat, layout.key_index).transpose(1, 2)  # (B, KV, p + W, D)
    v = _gather(v_flat, layout.key_index).transpose(1, 2)
    comp = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.completion_mask.to(q.dtype), scale=scale,
                                          enable_gqa=gqa)
    comp = _gather(comp.transpose(1, 2).reshape(-1, heads, dim), layout.out_select)  # (M, H, D)
    out = torch.zeros(rows * n, heads, dim, dtype=comp.dtype, device=query.device)  # autocast: SDPA's dtype
    out = out.index_copy(0, prompt.reshape(-1), prompt_out.transpose(1, 2).reshape(-1, heads, dim).to(comp.dtype))
    return out.index_copy(0, layout.out_index, comp).reshape(rows, n, heads, dim)
