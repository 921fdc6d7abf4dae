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

from grpo_cli.algo.chunk_size import CHUNK_ELEMENTS, rows_per_chunk


def chunk_rows(vocab: int) -> int:
    """Positions per chunk for a vocabulary of `vocab` entries (at least 1): `chunk_size.rows_per_chunk` of this
    module's `CHUNK_ELEMENTS` (which tests lower)."""
    return rows_per_chunk(vocab, CHUNK_ELEMENTS)


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


def _linear_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """z = h Wᵀ / τ in float32 (the matmul in the autocast dtype where autocast is on, as the layer computes it)."""
    z = torch.nn.functional.linear(hidden, weight).float()
    return z / temperature if temperature != 1.0 else z


def _entropy_of(z: Tensor, lse: Tensor) -> Tensor:
    """−Σ p log p of one chunk's logits z (n, V), overwriting z: 0·log 0 = 0, so banned logits add no NaN."""
    logp = z.sub_(lse[:, None])
    p = logp.exp()
    return -p.mul_(logp).masked_fill_(p == 0, 0.0).sum(-1)


class _LinearHead(torch.autograd.Function):
    """(logprob, entropy) of all N rows through a plain weight W (V, H), `chunk_rows(V)` rows at a time, the
    formulas above by hand. The forward keeps h, lse and the entropy only; the backward rebuilds each chunk's z
    under the forward's autocast state, turns it into ∂/∂z in place, writes the chunk's rows of ∂/∂h and adds its
    ∂/∂W into one (V, H) buffer (`addmm_`): one chunk's (n, V) float32 buffer plus its exp at a time, and one
    gradient of W for the whole call (not one per chunk that autograd would then add up)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, with_entropy: bool,
                entropy_grad: bool) -> tuple[Tensor, Tensor]:
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        rows = chunk_rows(weight.shape[0])
        logprob = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        lse, entropy = torch.empty_like(logprob), torch.zeros_like(logprob)
        for start in range(0, hidden.shape[0], rows):
            at = slice(start, start + rows)
            z = _linear_logits(hidden[at], weight, temperature)
            lse[at] = torch.logsumexp(z, dim=-1)
            logprob[at] = z.gather(-1, ids[at, None]).squeeze(-1) - lse[at]
            if with_entropy:
                entropy[at] = _entropy_of(z, lse[at])
            del z
        ctx.save_for_backward(hidden, weight, ids, lse, entropy)
        ctx.temperature, ctx.entropy_grad = temperature, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_logprob: Tensor, g_entropy: Tensor):
        hidden, weight, ids, lse, entropy = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        rows = chunk_rows(weight.shape[0])
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], rows):
                at = slice(start, start + rows)
                h, g_lp = hidden[at], g_logprob[at, None]
                logp = _linear_logits(h, weight, ctx.temperature).sub_(lse[at, None])
                p = logp.exp()
                if ctx.entropy_grad:  # −p (g_lp + g_H (log p + H)), 0 where p is 0
                    grad = logp.add_(entropy[at, None]).mul_(g_entropy[at, None]).add_(g_lp).mul_(p).neg_()
                    grad.masked_fill_(p == 0, 0.0)
                else:
                    grad = p.mul_(-g_lp)
                del logp, p
                grad.scatter_add_(-1, ids[at, None], g_lp.to(grad.dtype))  # + g_lp · onehot(id)
                if ctx.temperature != 1.0:
                    grad.div_(ctx.temperature)
                if enabled:  # the matmuls in the autocast dtype, as the layer's own backward runs them
                    grad_hidden[at] = torch.matmul(grad, weight)
                    grad_weight.add_(torch.matmul(grad.t(), h))
                else:  # a chunk-sized cast, never a (V, H) one; ∂/∂W accumulated in place
                    grad = grad.to(weight.dtype)
                    grad_hidden[at] = torch.matmul(grad, weight)
                    grad_weight.addmm_(grad.t(), h.to(grad.dtype))
                del grad
        return grad_hidden, grad_weight, None, None, None, None


def chunked_logprobs(hidden: Tensor, ids: Tensor, *, project: Callable[[Tensor], Tensor], weight: Tensor | None,
                     temperature: float, vocab: int, with_entropy: bool,
                     entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Logprobs (N,) of `ids` (N,) and the entropy (N,) (None unless `with_entropy`) of softmax(project(h) / τ) at
    every row of `hidden` (N, H), float32, `chunk_rows(vocab)` rows at a time.

    With `weight` (the plain (V, H) matrix `project` multiplies by, readable now and in backward) the chunks run in
    one `_LinearHead`, whose backward adds every chunk's ∂/∂W into one buffer. Without it, `project` maps hidden rows (n, H) to logits (n, V): the model's output layer called
    as a module (so sharded or wrapped weights are gathered the way that module gathers them), each chunk under
    non-reentrant activation checkpointing: the forward keeps only the chunk's hidden rows and the backward
    recomputes the chunk's logits. Either way at most one chunk's (n, V) tensors are alive. The entropy carries a
    gradient only with `entropy_grad`.
    """
    if weight is not None:
        logprob, entropy = _LinearHead.apply(hidden, weight, ids, temperature, with_entropy, entropy_grad)
        return logprob, entropy if with_entropy else None
    rows = chunk_rows(vocab)
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], rows):
        h, chunk_ids = hidden[start : start + rows], ids[start : start + rows]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_stats, h, chunk_ids, project, temperature, with_entropy, entropy_grad,
                                 use_reentrant=False)
        else:
            lp, ent = _stats(h, chunk_ids, project, temperature, with_entropy, entropy_grad)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:  # no rows: the (0,) results, still on the graph's dtype and device
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, empty if with_entropy else None
    return torch.cat(logprobs), torch.cat(entropies) if with_entropy else None
