"""Vocabulary-parallel embedding and output layer of a sequence-parallel forward (`sequence_logprobs`), on weights
that FSDP2 shards over exactly the sequence-parallel group (`train.backends.fsdp2` puts the input and output
embeddings in a unit of their own, `fully_shard([embedding, output layer])`, when the group is the whole mesh).

Each rank of the group holds rows start..start+V_r of the (V, H) embedding and output weight (FSDP2's `Shard(0)`
local shard, never gathered here):
- embedding: every rank looks up the ids of the whole packed row that fall in its rows (0 for the others), and a
  reduce-scatter sums the group's parts and leaves each rank its own positions (`_EmbedRows`);
- output layer: the hidden states of the positions that predict a completion token are gathered from the group
  (`_GatherRows`), and every rank projects all of them onto its rows in `algo.chunked_logprobs` with a `VocabShard`
  (log-sum-exp, picked logit and entropy reduced over the group per chunk): every rank ends with the whole
  micro-batch's logprobs and entropy, and no rank ever holds the whole weight, its gradient, or a logit of another
  rank's rows.

Gradients, in the group's convention (`train.backends.base`: each rank back-propagates loss / size, and FSDP2
averages a unit's gradients over the size ranks): the output layer's rows receive (1/size) ∂loss/∂W_rows directly,
which is what FSDP2's average would have made of them; `_GatherRows` hands each rank its own positions' ∂/∂h times
size (the share the trunk's gradients carry under the averaging); `_EmbedRows` gathers the group's ∂/∂embeddings and
divides them by size before adding them into the rows. FSDP2 never runs the unit's hooks on this path, so these
gradients are the parameters' sharded `.grad` as they are, beside the reduce-scattered gradients of every other unit.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_cli.models.sequence_attention import SequenceShard


@dataclass(frozen=True)
class VocabRows:
    """This rank's rows [start, start + len(local)) of a (V, `vocab`) weight row-sharded over its sequence-parallel
    group: `local` is the differentiable view of FSDP2's local shard, in the unit's compute dtype."""

    local: Tensor
    start: int
    vocab: int


def _compute_dtype(module: torch.nn.Module, weight: Tensor) -> torch.dtype:
    """The dtype FSDP2 would have gathered `module`'s weight in (its `MixedPrecisionPolicy.param_dtype`), else the
    weight's own. No public API exposes a unit's policy: FSDPState keeps it as `_mp_policy` (its root forward casts
    the inputs with it) in the releases pyproject.toml's floor admits, 2.6 to 2.13 here; a torch without it is an
    error, not a silent float32 head."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return weight.dtype
    policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
    if policy is None:
        raise RuntimeError("this torch's FSDP2 keeps no `_mp_policy` on its state; models/vocab_parallel.py reads the "
                           "compute dtype there and needs updating for it")
    return policy.param_dtype or weight.dtype


def vocab_rows(module: torch.nn.Module, shard: SequenceShard) -> VocabRows | None:
    """`module`'s weight as this rank's `VocabRows`, when it is a `Shard(0)` DTensor (sharded now: its unit is not
    unsharded) on a 1-D mesh whose ranks are `shard`'s group in order; else None. The same answer on every rank of the
    group (their modules are built alike and run the same forwards)."""
    from torch.distributed.tensor import Shard

    weight = getattr(module, "weight", None)
    if weight is None or not hasattr(weight, "placements"):
        return None
    mesh = weight.device_mesh
    if (mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),)
            or tuple(mesh.mesh.flatten().tolist()) != tuple(shard.global_ranks)):
        return None
    vocab = weight.shape[0]
    start = min(vocab, mesh.get_local_rank() * -(-vocab // mesh.size()))  # torch.chunk's rows, as FSDP2 cuts them
    local = weight.to_local()
    dtype = _compute_dtype(module, weight)
    return VocabRows(local if local.dtype == dtype else local.to(dtype), start, vocab)


def parallel_embedding(embedding: torch.nn.Module, shard: SequenceShard) -> VocabRows | None:
    """`vocab_rows` of the model's input embedding, when it is a plain lookup (`nn.Embedding`'s own forward, as
    FSDP2's subclass of it keeps, without max_norm: a scaled or otherwise wrapped embedding keeps its own forward)."""
    if type(embedding).forward is not torch.nn.Embedding.forward or embedding.max_norm is not None:
        return None
    return vocab_rows(embedding, shard)


def parallel_head(head: torch.nn.Module | None, shard: SequenceShard) -> VocabRows | None:
    """`vocab_rows` of the model's output layer, when it is y = h Wᵀ (`nn.Linear`'s own forward, no bias)."""
    if head is None or type(head).forward is not torch.nn.Linear.forward or head.bias is not None:
        return None
    return vocab_rows(head, shard)


class _EmbedRows(torch.autograd.Function):
    """(R, N/size, H) embeddings of this rank's positions [lo, hi) from the ids (R, N) of the whole row and this
    rank's vocabulary rows: each rank's lookup of the ids it holds (0 elsewhere), summed over the group by a
    reduce-scatter that keeps each rank its positions. Backward: the group's gradients of every position gathered,
    divided by the group size (the module docstring's convention), added into the rows of the ids this rank holds,
    except `padding_idx`'s (nn.Embedding's rule), in float32."""

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor, start: int, padding_idx: int | None,
                shard: SequenceShard) -> Tensor:
        rows = weight.shape[0]
        mine = (ids >= start) & (ids < start + rows)
        local = (ids - start).clamp(0, max(rows - 1, 0))
        parts = torch.nn.functional.embedding(local, weight) * mine[..., None].to(weight.dtype)
        stacked = parts.transpose(0, 1).contiguous()  # (N, R, H): the reduce-scatter splits dim 0
        out = stacked.new_empty((stacked.shape[0] // shard.size, *stacked.shape[1:]))
        dist.reduce_scatter_tensor(out, stacked, group=shard.group)
        if padding_idx is not None:
            mine = mine & (ids != padding_idx)
        ctx.save_for_backward(local, mine)
        ctx.shard, ctx.weight_shape, ctx.weight_dtype = shard, weight.shape, weight.dtype
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        local, mine = ctx.saved_tensors  # called only when the rows need a gradient (the ids are integers)
        shard = ctx.shard
        own = grad.transpose(0, 1).contiguous()
        every = own.new_empty((own.shape[0] * shard.size, *own.shape[1:]))
        dist.all_gather_into_tensor(every, own, group=shard.group)
        every = every.transpose(0, 1)  # (R, N, H)
        out = torch.zeros(ctx.weight_shape, dtype=torch.float32, device=grad.device)
        out.index_add_(0, local[mine], every[mine].float())
        return out.div_(shard.size).to(ctx.weight_dtype), None, None, None, None


def embed_positions(embedding: torch.nn.Module, rows: VocabRows, ids: Tensor, shard: SequenceShard) -> Tensor:
    """`inputs_embeds` (R, N/size, H) of this rank's positions of the packed row whose ids are `ids` (R, N)
    (`_EmbedRows`). Collective over the group, forward and backward."""
    return _EmbedRows.apply(rows.local, ids, rows.start, embedding.padding_idx, shard)


class _GatherRows(torch.autograd.Function):
    """(size · m, H) from every rank's (m, H) (padded to the group's most rows), in group order. Backward: this
    rank's block of the gradient times size (the module docstring's convention)."""

    @staticmethod
    def forward(ctx, rows: Tensor, shard: SequenceShard) -> Tensor:
        out = rows.new_empty((shard.size * rows.shape[0], *rows.shape[1:]))
        dist.all_gather_into_tensor(out, rows.contiguous(), group=shard.group)
        ctx.shard, ctx.count = shard, rows.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        at = ctx.shard.rank * ctx.count
        return grad[at : at + ctx.count] * ctx.shard.size, None


def gather_rows(rows: Tensor, counts: list[int], shard: SequenceShard) -> Tensor:
    """(Σ counts, H): every rank's first counts[r] rows of its (counts[rank], H) `rows`, in group order. Collective
    over the group (the same `counts` on every rank)."""
    most = max(counts)
    padded = torch.nn.functional.pad(rows, (0, 0, 0, most - rows.shape[0]))
    every = _GatherRows.apply(padded, shard)
    if all(c == most for c in counts):
        return every
    keep = torch.cat([torch.arange(r * most, r * most + c, device=rows.device) for r, c in enumerate(counts)])
    return every[keep]


def reduce_in(group, tensor: Tensor, op: str) -> None:
    """`tensor` all-reduced in place over `group`, op "max" or "sum" (a `VocabShard.all_reduce`, with the group
    bound: this module's sequence-parallel group, megatron's tensor-parallel one)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)


def group_reduce(shard: SequenceShard):
    """`VocabShard.all_reduce` over the sequence-parallel group (`reduce_in`)."""
    return functools.partial(reduce_in, shard.group)


class DetachedHead(torch.nn.Module):
    """Takes the output layer's place in its parent during one forward (`swapped`), so that the layer's own module
    (an FSDP2 unit, whose hooks would gather its weight) is not called: `fn(hidden)` is the forward."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, hidden: Tensor) -> Tensor:
        return self.fn(hidden)


@contextlib.contextmanager
def swapped(root: torch.nn.Module, old: torch.nn.Module, new: torch.nn.Module):
    """Context: `old` replaced by `new` in every parent module of `root` that holds it (restored on exit)."""
    slots = [(parent, name) for parent in root.modules() for name, child in parent._modules.items() if child is old]
    for parent, name in slots:
        parent._modules[name] = new
    try:
        yield new
    finally:
        for parent, name in slots:
            parent._modules[name] = old
