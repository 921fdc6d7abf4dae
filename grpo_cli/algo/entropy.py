"""Token entropy of the policy, H_t = −Σ_v p_v log p_v, straight from the logits of the training forward.

Row-chunked like `selective_log_softmax`: no second (…, V) buffer is built, and the backward pass recomputes
the softmax from the saved logits (which the logprob graph keeps anyway) instead of storing it.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 1024
"""Rows of logits turned into fp32 at once (forward and backward)."""


def _chunk_stats(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(p, log p, H) of fp32 logits rows z (n, V): log p = z − logsumexp(z), H = −Σ_v p_v log p_v (0·log 0 = 0,
    so −inf logits of banned tokens are fine)."""
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    p = logp.exp()
    return p, logp, -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)


class _ChunkedEntropy(torch.autograd.Function):
    """H per row of (N, V) logits, fp32 (N,); ∂H/∂z_v = −p_v (log p_v + H)."""

    @staticmethod
    def forward(ctx, flat: Tensor) -> Tensor:
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        for start in range(0, flat.shape[0], CHUNK_ROWS):
            out[start : start + CHUNK_ROWS] = _chunk_stats(flat[start : start + CHUNK_ROWS].float())[2]
        ctx.save_for_backward(flat, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        flat, entropy = ctx.saved_tensors
        grad_in = torch.empty_like(flat)
        for start in range(0, flat.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            p, logp, _ = _chunk_stats(flat[rows].float())
            local = torch.where(p > 0, p * (logp + entropy[rows, None]), torch.zeros_like(p))
            grad_in[rows] = (-grad[rows, None] * local).to(flat.dtype)
        return grad_in


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy H = −Σ_v p_v log p_v, p = softmax(z), of every position of logits (…, V), fp32 (…).

    Differentiable (the entropy bonus); pass detached logits for the metric alone. Pass the logits the logprobs
    come from (already divided by the sampling temperature), so H is the entropy of the sampling policy.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedEntropy.apply(flat).reshape(logits.shape[:-1])
