"""Ring attention: each rank's queries meet every shard's keys and values as the K/V blocks pass around the
sequence-parallel group, merged by their log-sum-exp (online softmax); the backward passes the blocks around again
with their gradients, which arrive back at the rank that owns them after `size` hops (FlashAttention's backward
per block: P = exp(S − lse), dS = P ∘ (dP − rowsum(dO ∘ O)))."""

from __future__ import annotations

import torch

FLOOR = -1e30
"""Log-sum-exp of a row that has seen no allowed key yet: finite, so merging two empty blocks stays 0, not NaN."""


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(R, KV, n, D) → (R, H, n, D): each K/V head repeated for its query heads (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv: int) -> torch.Tensor:
    """(R, H, n, D) gradients of the repeated heads → (R, KV, n, D), summed over each K/V head's query heads."""
    rows, heads, n, dim = t.shape
    return t if heads == kv else t.reshape(rows, kv, heads // kv, n, dim).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))


def _pass_on(tensors: list[torch.Tensor], shard) -> list[torch.Tensor]:
    """Send `tensors` (one buffer) to the next rank of the ring and receive the previous rank's."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors]).contiguous()
    got = torch.empty_like(flat)
    me, size, peers = shard.rank, shard.size, shard.global_ranks
    ops = [dist.P2POp(dist.isend, flat, peers[(me + 1) % size], group=shard.group),
           dist.P2POp(dist.irecv, got, peers[(me - 1) % size], group=shard.group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out, at = [], 0
    for t in tensors:
        out.append(got[at : at + t.numel()].view_as(t))
        at += t.numel()
    return out


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, row, scale):
        with torch.autocast(q.device.type, enabled=False):  # float32 throughout, whatever the compute dtype
            return _Ring._forward(ctx, q, k, v, row, scale)

    @staticmethod
    def _forward(ctx, q, k, v, row, scale):
        shard, heads = row.shard, q.shape[1]
        qf = q.float()
        acc = torch.zeros_like(qf)
        lse = torch.full((*q.shape[:3], 1), FLOOR, dtype=torch.float32, device=q.device)
        kb, vb = k.float(), v.float()
        for step in range(shard.size):
            src = (shard.rank - step) % shard.size
            allowed = row.allowed(shard.rank, src)
            if bool(allowed.any()):
                s = _scores(qf, _expand(kb, heads), allowed, scale)
                lse_b = torch.logsumexp(s, dim=-1, keepdim=True).clamp(min=FLOOR)
                out_b = torch.exp(s - lse_b) @ _expand(vb, heads)
                merged = torch.logaddexp(lse, lse_b)
                acc = acc * torch.exp(lse - merged) + out_b * torch.exp(lse_b - merged)
                lse = merged
            if step < shard.size - 1:
                kb, vb = _pass_on([kb, vb], shard)
        ctx.save_for_backward(q, k, v, acc, lse)
        ctx.row, ctx.scale = row, scale
        return acc.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _Ring._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        row, scale = ctx.row, ctx.scale
        shard, heads, kv = row.shard, q.shape[1], k.shape[1]
        qf, go = q.float(), grad_out.float()
        delta = (go * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        kb, vb = k.float(), v.float()
        dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
        for step in range(shard.size):
            src = (shard.rank - step) % shard.size
            allowed = row.allowed(shard.rank, src)
            if bool(allowed.any()):
                ke, ve = _expand(kb, heads), _expand(vb, heads)
                p = torch.exp(_scores(qf, ke, allowed, scale) - lse)
                ds = p * (go @ ve.transpose(-1, -2) - delta)
                dq = dq + ds @ ke * scale
                dk = dk + _fold(ds.transpose(-1, -2) @ qf * scale, kv)
                dv = dv + _fold(p.transpose(-1, -2) @ go, kv)
            if shard.size > 1:  # after `size` hops each block's gradient is back at its owner
                kb, vb, dk, dv = _pass_on([kb, vb, dk, dv], shard)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row, *, scale: float) -> torch.Tensor:
    """Attention (R, H, n, D) of this rank's queries (R, H, n, D) over the whole row's keys/values, which arrive
    block by block from the other ranks (key/value (R, KV, n, D) each); `row`: `sequence_attention.ShardedRow`
    (the mask of each query block × key block). Computed in float32."""
    return _Ring.apply(query, key, value, row, scale)
