"""Ring attention: each rank's queries meet every shard's keys and values as the K/V blocks pass around the
sequence-parallel group, merged by their log-sum-exp (online softmax); the backward passes the blocks around again
with their gradients, which arrive back at the rank that owns them after `size` hops (FlashAttention's backward
per block: P = exp(S − lse), dS = P ∘ (dP − rowsum(dO ∘ O)), with the merged O and lse of the whole row).

Each block runs through PyTorch's fused CPU flash-attention kernel where the tensors are on the CPU (`FUSED`), which
returns the block's log-sum-exp and whose backward takes the merged one; elsewhere the scores are computed by hand,
a query chunk at a time (`_forward_block`, `_backward_block`)."""

from __future__ import annotations

import functools

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
    """q·kᵀ·scale, −inf where not `allowed` (a fresh tensor the callers overwrite in place)."""
    return (q @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~allowed, float("-inf"))


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


FUSED = True
"""Whether CPU blocks use `aten._scaled_dot_product_flash_attention_for_cpu` and its backward (the tests also run the
hand-written path on the CPU by setting this False). The CUDA kernels' log-sum-exp layouts differ by kernel and
version; CUDA keeps the hand-written path."""


def _fused(q: torch.Tensor) -> bool:
    return FUSED and q.device.type == "cpu"


SCORES = 1 << 24
"""Score elements (float32: 64 MiB) one query chunk × key block computes at a time: ring attention holds no
(n × n × heads) score tensor whole, in the forward or the backward."""


def _chunks(q: torch.Tensor, keys: int):
    """Slices of query positions, each small enough that its scores over `keys` keys stay within SCORES."""
    rows, heads, n, _ = q.shape
    step = max(1, SCORES // max(1, rows * heads * keys))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _keys(rows: slice, src: int, shard, n: int) -> int:
    """Keys of block `src` a query chunk can see: on its own block, none past its last query (the mask is causal in
    the packed row), so the diagonal block costs half."""
    return rows.stop if src == shard.rank else n


def _forward_block(qf, kb, vb, acc, lse, row, src, scale) -> None:
    """Merge key block `src` into (acc, lse) in place, a query chunk at a time (log-sum-exp merge)."""
    shard, heads = row.shard, qf.shape[1]
    ke, ve = _expand(kb, heads), _expand(vb, heads)
    for c in _chunks(qf, kb.shape[2]):
        keys = _keys(c, src, shard, kb.shape[2])
        allowed = row.allowed(shard.rank, src, c, keys)
        if not bool(allowed.any()):
            continue
        s = _scores(qf[:, :, c], ke[:, :, :keys], allowed, scale)
        top = s.amax(dim=-1, keepdim=True).clamp_(min=FLOOR)  # a row with no allowed key: exp(−inf) = 0 below
        total = s.sub_(top).exp_().sum(dim=-1, keepdim=True)
        out_b = (s @ ve[:, :, :keys]).div_(total.clamp(min=torch.finfo(s.dtype).tiny))
        _merge(acc, lse, c, out_b, (top + total.log()).clamp_(min=FLOOR))


def _merge(acc, lse, c: slice, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """(acc, lse)[c] ← the softmax over both key sets: lse' = logaddexp(lse, lse_b), acc' = acc·e^(lse − lse') +
    out_b·e^(lse_b − lse'), in place (lse, lse_b: (R, H, n, 1))."""
    merged = torch.logaddexp(lse[:, :, c], lse_b)
    acc[:, :, c] = acc[:, :, c] * torch.exp(lse[:, :, c] - merged) + out_b * torch.exp(lse_b - merged)
    lse[:, :, c] = merged


def _pieces(qf: torch.Tensor, keys_in_block: int, row, src: int):
    """The fused kernel's calls for key block `src`: (query slice, keys, causal, additive mask or None, which query
    rows see a key (R, 1, q) or None). A one-sequence row (`row.causal`) needs no mask: the blocks before this rank's
    are whole, its own is causal, those after it unseen. Any other row: `_chunks` of queries with their float mask
    (0 allowed, −inf not), skipping chunks that see nothing."""
    shard = row.shard
    if row.causal:
        if src <= shard.rank:
            yield slice(0, qf.shape[2]), keys_in_block, src == shard.rank, None, None
        return
    for c in _chunks(qf, keys_in_block):
        keys = _keys(c, src, shard, keys_in_block)
        allowed = row.allowed(shard.rank, src, c, keys)
        if bool(allowed.any()):
            mask = torch.zeros(allowed.shape, dtype=qf.dtype, device=qf.device).masked_fill_(~allowed, float("-inf"))
            yield c, keys, False, mask, allowed.any(-1)


def _fused_forward_block(qf, kb, vb, acc, lse, row, src, scale) -> None:
    """`_forward_block` through the fused kernel: each call returns the block's output and log-sum-exp (0, not −inf,
    for a query row that sees no key: set to FLOOR so the merge gives it no weight)."""
    heads = qf.shape[1]
    ke, ve = _expand(kb, heads), _expand(vb, heads)
    for c, keys, causal, mask, seen in _pieces(qf, kb.shape[2], row, src):
        out_b, lse_b = _FLASH(qf[:, :, c].contiguous(), ke[:, :, :keys].contiguous(), ve[:, :, :keys].contiguous(),
                              0.0, causal, attn_mask=mask, scale=scale)
        lse_b = lse_b.unsqueeze(-1)
        if seen is not None:
            lse_b = lse_b.masked_fill(~seen[..., None], FLOOR)
        _merge(acc, lse, c, out_b, lse_b)


def _fused_backward_block(qf, go, out, lse, kb, vb, grads, row, src, scale) -> None:
    """`_backward_block` through the fused kernel's backward, given the merged output and log-sum-exp (so its
    P = exp(S − lse) is the block's share of the whole row's softmax)."""
    heads, kv = qf.shape[1], kb.shape[1]
    ke, ve = _expand(kb, heads), _expand(vb, heads)
    dq, dk, dv = grads
    for c, keys, causal, mask, _ in _pieces(qf, kb.shape[2], row, src):
        gq, gk, gv = _FLASH_BACKWARD(go[:, :, c].contiguous(), qf[:, :, c].contiguous(), ke[:, :, :keys].contiguous(),
                                     ve[:, :, :keys].contiguous(), out[:, :, c].contiguous(),
                                     lse[:, :, c, 0].contiguous(), 0.0, causal, attn_mask=mask, scale=scale)
        dq[:, :, c] += gq
        dk[:, :, :keys] += _fold(gk, kv)
        dv[:, :, :keys] += _fold(gv, kv)


def _backward_block(qf, go, lse, delta, kb, vb, grads, row, src, scale) -> None:
    """Add key block `src`'s share to grads = [dq, dk, dv] in place, a query chunk at a time."""
    shard, heads, kv = row.shard, qf.shape[1], kb.shape[1]
    ke, ve = _expand(kb, heads), _expand(vb, heads)
    dq, dk, dv = grads
    for c in _chunks(qf, kb.shape[2]):
        keys = _keys(c, src, shard, kb.shape[2])
        allowed = row.allowed(shard.rank, src, c, keys)
        if not bool(allowed.any()):
            continue
        q, g, kc, vc = qf[:, :, c], go[:, :, c], ke[:, :, :keys], ve[:, :, :keys]
        p = _scores(q, kc, allowed, scale).sub_(lse[:, :, c]).exp_()
        ds = (g @ vc.transpose(-1, -2)).sub_(delta[:, :, c]).mul_(p)
        dq[:, :, c] += ds @ kc * scale
        dk[:, :, :keys] += _fold(ds.transpose(-1, -2) @ q * scale, kv)
        dv[:, :, :keys] += _fold(p.transpose(-1, -2) @ g, kv)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, row, scale):
        with torch.autocast(q.device.type, enabled=False):  # float32 throughout, whatever the compute dtype
            shard, qf = row.shard, q.float()
            acc = torch.zeros_like(qf)
            lse = torch.full((*q.shape[:3], 1), FLOOR, dtype=torch.float32, device=q.device)
            kb, vb = k.float(), v.float()
            block = _fused_forward_block if _fused(qf) else _forward_block
            for step in range(shard.size):
                block(qf, kb, vb, acc, lse, row, (shard.rank - step) % shard.size, scale)
                if step < shard.size - 1:
                    kb, vb = _pass_on([kb, vb], shard)
        ctx.save_for_backward(q, k, v, acc, lse)
        ctx.row, ctx.scale = row, scale
        return acc.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        row, shard = ctx.row, ctx.row.shard
        with torch.autocast(grad_out.device.type, enabled=False):
            qf, go = q.float(), grad_out.float()
            if _fused(qf):  # the kernel's backward computes rowsum(dO ∘ O) from the merged output itself
                block = functools.partial(_fused_backward_block, qf, go, out, lse)
            else:
                block = functools.partial(_backward_block, qf, go, lse, (go * out).sum(-1, keepdim=True))
            kb, vb = k.float(), v.float()
            dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kb), torch.zeros_like(vb)
            for step in range(shard.size):
                block(kb, vb, [dq, dk, dv], row, (shard.rank - step) % shard.size, ctx.scale)
                if shard.size > 1:  # after `size` hops each block's gradient is back at its owner
                    kb, vb, dk, dv = _pass_on([kb, vb, dk, dv], shard)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row, *, scale: float) -> torch.Tensor:
    """Attention (R, H, n, D) of this rank's queries (R, H, n, D) over the whole row's keys/values, which arrive
    block by block from the other ranks (key/value (R, KV, n, D) each); `row`: `sequence_attention.ShardedRow`
    (the mask of each query block × key block). Computed in float32."""
    return _Ring.apply(query, key, value, row, scale)
