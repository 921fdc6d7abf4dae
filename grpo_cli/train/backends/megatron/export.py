"""Full Hugging Face-named tensors from this rank's Megatron shards, gathered bucket by bucket: one broadcast per
pipeline stage (its shards, flattened) and one all-gather over the tensor-parallel ranks per bucket, instead of
mbridge's per-tensor object collectives. A bucket holds tensors up to `bucket_mb` of full size (a larger tensor is
a bucket of its own), which bounds what a sync gathers at once."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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


def _full_bytes(e: Entry, tp: int, itemsize: int) -> int:
    return e.numel * (tp if e.split else 1) * itemsize


def _buckets(entries: list[Entry], tp: int, cap_bytes: float, itemsize: int) -> Iterator[list[Entry]]:
    bucket, size = [], 0
    for e in entries:
        full = _full_bytes(e, tp, itemsize)
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

    pp_group, tp_group = mpu.get_pipeline_model_parallel_group(), mpu.get_tensor_model_parallel_group()
    stage, tp = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    mine, tensors = _local_entries(bridge, chunks, stage)
    local = dict(zip(mine, tensors, strict=True))
    every: list = [None] * mpu.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(every, mine, group=pp_group)
    dtype, device = tensors[0].dtype, tensors[0].device
    stats = stats if stats is not None else {}
    seen: set[str] = set()
    itemsize = tensors[0].element_size()
    for bucket in _buckets([e for part in every for e in part], tp, bucket_mb * 2**20, itemsize):
        sizes = [_full_bytes(e, tp, itemsize) for e in bucket]
        stats["buckets"] = stats.get("buckets", 0) + 1
        stats["largest_bucket"] = max(stats.get("largest_bucket", 0), sum(sizes))
        stats["largest_tensor"] = max(stats.get("largest_tensor", 0), *sizes)
        out = []
        for owner in sorted({e.stage for e in bucket}):
            part = [e for e in bucket if e.stage == owner]
            flat = _stage_buffer(part, local if owner == stage else None, dtype, device)
            if len(every) > 1:
                torch.distributed.broadcast(flat, src=torch.distributed.get_global_rank(pp_group, owner),
                                            group=pp_group)
            shards = [flat]
            if tp > 1:
                shards = [torch.empty_like(flat) for _ in range(tp)]
                torch.distributed.all_gather(shards, flat, group=tp_group)
            stats["collectives"] = stats.get("collectives", 0) + (len(every) > 1) + (tp > 1)
            out.extend(_convert(bridge, part, shards, seen))
        yield out


def _stage_buffer(part: list[Entry], local: dict | None, dtype, device) -> torch.Tensor:
    if local is None:
        return torch.empty(sum(e.numel for e in part), dtype=dtype, device=device)
    return torch.cat([local[e].reshape(-1) for e in part])


def _convert(bridge, part: list[Entry], shards: list[torch.Tensor], seen: set[str]):
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
