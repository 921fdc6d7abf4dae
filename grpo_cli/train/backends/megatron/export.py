"""Full Hugging Face-named tensors from this rank's Megatron shards, gathered bucket by bucket: one broadcast per
pipeline stage (its shards, flattened) and one all-gather over the tensor-parallel ranks per bucket, instead of
mbridge's per-tensor object collectives. MoE expert weights are gathered over the expert tensor-parallel ranks and
then over the expert-parallel ranks (each holds its own experts: local expert e of ep rank r is global expert
e + r · experts per rank). A bucket holds tensors up to `bucket_mb` of full size (a larger tensor is a bucket of its
own), which bounds what a sync gathers at once."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Entry:
    """One parameter of one pipeline stage: its global Megatron name, local (tensor-parallel shard) shape and how it
    splits across tensor-parallel ranks."""

    stage: int
    name: str
    shape: tuple[int, ...]
    split: bool
    partition_dim: int

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def expert(self) -> bool:
        """A routed expert's weight (grouped name `…mlp.experts.linear_fc{1,2}.weight{e}`, e local to its rank)."""
        return EXPERT_MARK in self.name

    def as_expert(self, first: int) -> "Entry":
        """This expert weight named for the rank whose experts start at global index `first`."""
        prefix, local = self.name.rsplit(".weight", 1)
        return replace(self, name=f"{prefix}.weight{int(local) + first}")


EXPERT_MARK = ".mlp.experts.linear_fc"


def _local_entries(bridge, chunks: list[torch.nn.Module], stage: int) -> tuple[list[Entry], list[torch.Tensor]]:
    from mbridge.core.util import unwrap_model

    entries, tensors = [], []
    for chunk in chunks:
        global_names = bridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=False)
        for name, p in unwrap_model(chunk).named_parameters():
            entries.append(Entry(stage, global_names[name], tuple(p.shape), bool(getattr(p, "tensor_model_parallel",
                                 False)), int(getattr(p, "partition_dim", 0))))
            tensors.append(p.detach())
    return entries, tensors


@dataclass(frozen=True)
class Grid:
    """The process groups a gather runs over, and their sizes (experts: expert tensor parallel × expert parallel)."""

    pp_group: object
    tp_group: object
    tp: int
    etp_group: object
    etp: int
    ep_group: object
    ep: int
    experts_per_rank: int

    @classmethod
    def current(cls, bridge) -> "Grid":
        from megatron.core import parallel_state as mpu

        ep = mpu.get_expert_model_parallel_world_size()
        return cls(mpu.get_pipeline_model_parallel_group(), mpu.get_tensor_model_parallel_group(),
                   mpu.get_tensor_model_parallel_world_size(), mpu.get_expert_tensor_parallel_group(),
                   mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_model_parallel_group(), ep,
                   (getattr(bridge.config, "num_moe_experts", None) or 0) // ep)

    def full_bytes(self, e: Entry, itemsize: int) -> int:
        if e.expert:
            return e.numel * (self.etp if e.split else 1) * self.ep * itemsize
        return e.numel * (self.tp if e.split else 1) * itemsize


def _buckets(entries: list[Entry], grid: Grid, cap_bytes: float, itemsize: int) -> Iterator[list[Entry]]:
    bucket, size = [], 0
    for e in entries:
        full = grid.full_bytes(e, itemsize)
        if bucket and size + full > cap_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(e)
        size += full
    if bucket:
        yield bucket


def hf_tensor_buckets(bridge, chunks: list[torch.nn.Module], *, bucket_mb: float,
                      stats: dict | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Collective over every rank: lists of (HF name, full tensor) per bucket, the same on every rank; a tied
    embedding appears once. `stats` (optional) counts "buckets" and "collectives" and records the full bytes of the
    largest bucket and of the largest (Megatron) tensor."""
    from megatron.core import parallel_state as mpu

    grid = Grid.current(bridge)
    stage = mpu.get_pipeline_model_parallel_rank()
    mine, tensors = _local_entries(bridge, chunks, stage)
    local = dict(zip(mine, tensors, strict=True))
    every: list = [None] * mpu.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(every, mine, group=grid.pp_group)
    dtype, device = tensors[0].dtype, tensors[0].device
    stats = stats if stats is not None else {}
    seen: set[str] = set()
    itemsize = tensors[0].element_size()
    for bucket in _buckets([e for part in every for e in part], grid, bucket_mb * 2**20, itemsize):
        sizes = [grid.full_bytes(e, itemsize) for e in bucket]
        stats["buckets"] = stats.get("buckets", 0) + 1
        stats["largest_bucket"] = max(stats.get("largest_bucket", 0), sum(sizes))
        stats["largest_tensor"] = max(stats.get("largest_tensor", 0), *sizes)
        out = []
        for owner in sorted({e.stage for e in bucket}):
            for expert in (False, True):
                part = [e for e in bucket if e.stage == owner and e.expert == expert]
                if part:
                    flat = _stage_buffer(part, local if owner == stage else None, dtype, device)
                    if len(every) > 1:
                        torch.distributed.broadcast(flat, src=torch.distributed.get_global_rank(grid.pp_group, owner),
                                                    group=grid.pp_group)
                        stats["collectives"] = stats.get("collectives", 0) + 1
                    out.extend(_expert_tensors(bridge, part, flat, grid, seen, stats) if expert else
                               _convert(bridge, part, _gather(flat, grid.tp_group, grid.tp, stats), seen))
        yield out


def _gather(flat: torch.Tensor, group, size: int, stats: dict) -> list[torch.Tensor]:
    """Every rank's `flat` of `group` (size `size`), in rank order."""
    if size == 1:
        return [flat]
    shards = [torch.empty_like(flat) for _ in range(size)]
    torch.distributed.all_gather(shards, flat, group=group)
    stats["collectives"] = stats.get("collectives", 0) + 1
    return shards


def _expert_tensors(bridge, part: list[Entry], flat: torch.Tensor, grid: Grid, seen: set[str], stats: dict):
    """Full HF expert tensors of every expert-parallel rank: this stage's expert shards gathered over expert tensor
    parallel, then the concatenation over expert parallel, each rank's experts renamed to their global index."""
    per_rank = _gather(torch.cat(_gather(flat, grid.etp_group, grid.etp, stats)), grid.ep_group, grid.ep, stats)
    for r, joined in enumerate(per_rank):
        named = [e.as_expert(r * grid.experts_per_rank) for e in part]
        yield from _convert(bridge, named, list(joined.chunk(grid.etp)), seen)


def _stage_buffer(part: list[Entry], local: dict | None, dtype, device) -> torch.Tensor:
    if local is None:
        return torch.empty(sum(e.numel for e in part), dtype=dtype, device=device)
    return torch.cat([local[e].reshape(-1) for e in part])


def _convert(bridge, part: list[Entry], shards: list[torch.Tensor], seen: set[str]):
    """(HF name, tensor) pairs of `part` from each tensor-parallel rank's flat buffer (`shards`), merged across
    ranks and converted by mbridge; a name already given (tied embeddings) is skipped."""
    offset = 0
    for e in part:
        pieces = [s[offset:offset + e.numel].view(e.shape) for s in shards]
        offset += e.numel
        if e.split and len(pieces) > 1:
            like = pieces[0]
            like.tensor_model_parallel, like.partition_dim = True, e.partition_dim
            merged = bridge._weight_merge_across_tp(e.name, pieces, like)
        else:
            merged = pieces[0]
        for name, tensor in zip(*bridge._weight_to_hf_format(e.name, merged), strict=True):
            if name not in seen:
                seen.add(name)
                yield name, tensor.clone()
