"""Logprobs and entropy through the output projection a chunk of positions at a time: the (N, V) logits are never
whole. Each chunk's logits are built, reduced to (logprob, entropy) and freed; the backward rebuilds them per chunk.

For a position with hidden state h (H,), projection W (V, H) and sampling temperature τ:
    z = h Wᵀ / τ,   lse = logsumexp(z),   logprob = z[id] − lse,   entropy = lse − Σ_v softmax(z)_v · z_v
and, with p = softmax(z), the gradients the recomputed chunk back-propagates:
    ∂logprob/∂z = onehot(id) − p,   ∂entropy/∂z_v = −p_v (log p_v + entropy),
    ∂/∂h = (∂/∂z) W / τ,   ∂/∂W = (∂/∂z)ᵀ h / τ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 24
"""Logits elements per chunk (64 MB in float32): rows per chunk = this // vocabulary, so the peak is a few such
buffers (the chunk's logits, softmax and their gradient) whatever the batch, length or vocabulary."""


def chunk_rows(vocab: int) -> int:
    """Positions per chunk for a vocabulary of `vocab` entries (at least 1)."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def _stats(hidden: Tensor, ids: Tensor, project: Callable[[Tensor], Tensor], temperature: float,
           with_entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """(logprob, entropy) of one chunk, float32 (n,); the entropy is zeros when not asked for."""
    z = project(hidden).float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprob = z.gather(-1, ids[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprob, torch.zeros_like(lse)
    if not entropy_grad:
        z, lse = z.detach(), lse.detach()
    logp = z - lse[:, None]
    p = logp.exp()
    # −Σ p log p (= lse − Σ p z, as `algo.entropy` sums it); 0 where p is 0, so a banned (−inf) logit adds no NaN
    return logprob, -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def chunked_logprobs(hidden: Tensor, ids: Tensor, *, project: Callable[[Tensor], Tensor], temperature: float,
                     vocab: int, with_entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Logprobs (N,) of `ids` (N,) and the entropy (N,) (None unless `with_entropy`) of softmax(project(h) / τ) at
    every row of `hidden` (N, H), float32, `chunk_rows(vocab)` rows at a time.

    `project` maps hidden rows (n, H) to logits (n, V): the model's output layer called as a module (so sharded or
    wrapped weights are gathered the way that module gathers them). With grad enabled each chunk runs under
    non-reentrant activation checkpointing: the forward keeps only the chunk's hidden rows, and the backward
    recomputes the chunk's logits, so at most one chunk's (n, V) tensors are alive. The entropy carries a gradient
    only with `entropy_grad`.
    """
    rows = chunk_rows(vocab)
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], rows):
        args = (hidden[start : start + rows], ids[start : start + rows], project, temperature, with_entropy,
                entropy_grad)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_stats, *args, use_reentrant=False)
        else:
            lp, ent = _stats(*args)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:  # no rows: the (0,) results, still on the graph's dtype and device
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, empty if with_entropy else None
    return torch.cat(logprobs), torch.cat(entropies) if with_entropy else None
