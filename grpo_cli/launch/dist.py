"""Process-group facts and the few collectives the loop needs (no-ops in a single process)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env(device_type: str) -> DistInfo:
    """Join the process group that torchrun/accelerate described in the environment (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def all_reduce_sum(value: float, info: DistInfo) -> float:
    if info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def mean_metrics(metrics: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Average every scalar metric over ranks (same keys on every rank)."""
    if info.world_size == 1:
        return metrics
    keys = sorted(metrics)
    t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / info.world_size for k, v in zip(keys, t, strict=True)}


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """End of a job: wait for every rank (rank 0 may still be writing), then tear the process group down here
    rather than in interpreter teardown, where a rank exiting early aborted ("terminate called without an active
    exception") and its launcher killed the ranks still writing."""
    if info.world_size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def broadcast_object(obj, info: DistInfo):
    """Rank 0's `obj` on every rank (a picklable object; collective, every rank calls it)."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
