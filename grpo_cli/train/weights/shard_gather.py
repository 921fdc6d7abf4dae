"""Full tensors of a weight-sync bucket of FSDP2 parameters from one all-gather per dtype, not one per tensor.

FSDP2 shards every parameter `Shard(0)` over W ranks by torch.chunk's rule: with `n` rows, each rank holds rows
[r·c, min(n, (r+1)·c)), c = ⌈n/W⌉ (the last ranks may hold fewer, or none). Under HSDP (`distributed.fsdp2.replicate`)
the mesh is 2-D, `(Replicate(), Shard(0))`: W and r are those of the shard dimension, and the gather runs in this
rank's shard group, which holds one whole copy. Each rank lays its bucket's local shards end to end, each padded to
c rows, into one flat buffer; `all_gather_into_tensor` stacks the W buffers, so parameter p is the column block
[off_p, off_p + c·row_p) of the (W, total) gathered view: the (W·c, …) rows in order, of which the first n are the
tensor. Peak memory is the bucket (`weight_sync_bucket_mb`) plus its shards and the tensor being copied out (a
bucket of one tensor is a view, no copy).

The shards are cast to the engine's dtype before the collective (float32 masters → a bf16 engine: half the bytes on
the wire), and gathered on the training device: under `fsdp2.cpu_offload` the shards live in host memory, and the
collective would otherwise run on the host over gloo (~280 GB per step at 70B) instead of the GPU's NCCL."""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_cli.runtime import accel


def shard_rows(param, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of dim 0 that `rank` holds of a `Shard(0)` parameter (torch.chunk's split, as above)."""
    n = param.shape[0]
    chunk = -(-n // world)
    start = min(n, rank * chunk)
    return start, min(n, start + chunk)


def shard_dim(tensor) -> int | None:
    """The mesh dimension a DTensor is row-sharded over (`Shard(0)` there, `Replicate()` on every other: what
    `fully_shard` makes, on a 1-D mesh or HSDP's 2-D one); None for anything else (gathered with `full_tensor`)."""
    from torch.distributed.tensor import Replicate, Shard

    if not hasattr(tensor, "placements") or tensor.dim() == 0:
        return None
    placements = tuple(tensor.placements)
    dims = [i for i, p in enumerate(placements) if p == Shard(0)]
    if len(dims) != 1 or any(p != Replicate() for i, p in enumerate(placements) if i != dims[0]):
        return None
    return dims[0]


def row_sharded(tensor: torch.Tensor) -> bool:
    """Whether `GatheredBucket` gathers `tensor` (a row-sharded DTensor, `shard_dim`)."""
    return shard_dim(tensor) is not None


def local_rows(param) -> tuple[int, int]:
    """[start, stop) of dim 0 this rank holds of `param`: its rows of a row-sharded DTensor (its coordinate in the
    shard dimension of the mesh), every row of anything else."""
    dim = shard_dim(param)
    if dim is None:
        return 0, param.shape[0]
    mesh = param.device_mesh
    return shard_rows(param, mesh.get_local_rank(dim), mesh.size(dim))


class GatheredBucket:
    """The full tensors of `params` (row-sharded DTensors, `shard_dim`), gathered at construction (collective:
    every rank builds it for the same bucket); `full(param)` copies one out of the gathered buffer.

    `dtype`: the dtype to gather floating tensors in (the engine's; None: their own), except the parameters in
    `exact` (LoRA base weights, merged with their adapter in their own precision before the cast). `device`: where
    the collective runs (the training device, resolved once; None: where the shards are)."""

    def __init__(self, params: list[torch.Tensor], *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, exact: frozenset[int] = frozenset()) -> None:
        self._where: dict[int, tuple[torch.Tensor, int, int, int]] = {}
        """id(param): (gathered (W, total) view, element offset, elements per rank, rows per rank)."""
        self.device = device
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:  # one collective per dtype and mesh (FSDP2: one mesh, one engine dtype)
            wire = dtype if dtype is not None and p.is_floating_point() and id(p) not in exact else p.dtype
            groups.setdefault((wire, p.device_mesh, shard_dim(p)), []).append(p)
        for (wire, mesh, dim), group in groups.items():
            self._gather(group, wire, mesh, dim)

    @torch.no_grad()
    def _gather(self, group: list[torch.Tensor], dtype: torch.dtype, mesh, dim: int) -> None:
        world = mesh.size(dim)
        layout, total = [], 0
        for p in group:
            rows = -(-p.shape[0] // world)  # torch.chunk's rows per rank
            slot = rows * (p.numel() // p.shape[0] if p.shape[0] else 0)
            layout.append((p, total, slot, rows))
            total += slot
        local = group[0].to_local()
        shards = torch.zeros(total, dtype=dtype, device=local.device)  # laid out (and cast) where the shards are
        for p, off, _, _ in layout:
            mine = p.to_local()
            shards[off:off + mine.numel()].view(mine.shape).copy_(mine)
        shards = accel.to_device(shards, self.device or local.device)  # one copy of the bucket, host → GPU
        gathered = torch.empty(world * total, dtype=dtype, device=shards.device)
        # torch 2.13 names it all_gather_single (all_gather_into_tensor warns as deprecated); torch < 2.13 lacks it
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, shards, group=mesh.get_group(dim))  # HSDP: this rank's shard group only
        view = gathered.view(world, total)
        for p, off, slot, rows in layout:
            self._where[id(p)] = (view, off, slot, rows)

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._where

    def full(self, param: torch.Tensor) -> torch.Tensor:
        """The whole of `param` (a copy, or a view of the gathered buffer when it is the bucket's only tensor)."""
        view, off, slot, rows = self._where[id(param)]
        world = view.shape[0]
        block = view[:, off:off + slot].reshape(world * rows, *param.shape[1:])  # a view when slot == total
        return block[:param.shape[0]]
