"""The device-specific calls (CUDA's pinning, synchronize, empty_cache, set_device, RNG) behind small functions
whose callers are the same on every device: code above this module never branches on `device.type`.

Each function is a no-op (or the plain CPU equivalent) on a non-CUDA device; a CPU test drives the CUDA branch by
passing a `torch.device("cuda", i)` with the CUDA call patched."""

from __future__ import annotations

import os
import weakref

import torch

_READERS: list[weakref.WeakMethod] = []
"""The memory readers `memory_changing` calls (held weakly: a run's timer goes with its run)."""


def resolve_device(setting: str, local_rank: int, *, cuda_available: bool | None = None) -> torch.device:
    """The training device of this process, resolved once from `distributed.device` and passed down everywhere:
    `cuda` → `cuda:local_rank`; `auto` → the same when CUDA is available, else `cpu`; `cpu` → `cpu`."""
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if setting == "cuda" or (setting == "auto" and available):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def local_rank_from_env() -> int:
    """This process's index on its machine, as torchrun/accelerate export it (0 in a single process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def set_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (before any process group or CUDA tensor exists), so
    collectives and `cuda` tensors without an index use this rank's own GPU, not cuda:0."""
    if is_cuda(device):
        torch.cuda.set_device(device)


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index`, written as SGLang's torch-reductions patch writes and reads
    it (`str(get_device_properties(i).uuid)`): it names the same GPU under any CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(index).uuid)


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def empty_cache(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the driver (for a colocated engine to take)."""
    if is_cuda(device):
        torch.cuda.empty_cache()


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """The peaks of this process's CUDA caching allocator on `device` since the last `reset_peak_memory`, in MiB:
    `allocated` (tensors) and `reserved` (what the allocator holds from the driver, what nvidia-smi sees of it);
    {} on a device without one (the CPU's figure is the process's peak RSS)."""
    if not is_cuda(device):
        return {}
    return {"allocated": torch.cuda.max_memory_allocated(device) / 2**20,
            "reserved": torch.cuda.max_memory_reserved(device) / 2**20}


def device_in_use_mb(device: torch.device) -> dict[str, float]:
    """What CUDA `device` has in use now, in MiB: `used`, the device's own figure (`total − free` of `mem_get_info`,
    every process and context on it, what nvidia-smi shows), and `reserved`, this process's allocator's holding now;
    {} on a device without one. Memory a sleeping vLLM engine unmapped is free here but still on the allocator's books
    (vLLM allocates through a torch MemPool; vLLM issues #17117, #33625)."""
    if not is_cuda(device):
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"used": (total - free) / 2**20, "reserved": torch.cuda.memory_reserved(device) / 2**20}


def on_memory_change(reader) -> None:
    """Have the bound method `reader` (a peak reader's `mark`) called at every `memory_changing`."""
    _READERS.append(weakref.WeakMethod(reader))


def memory_changing() -> None:
    """Called by a colocated engine right before it sleeps and right after it wakes: device memory is unmapped or
    mapped again while the allocator's books stay as they were, so every reader takes its reading now, and none of
    its readings spans the change (`train.supervise.timing.device_peak_mb` is exact within each)."""
    for ref in list(_READERS):
        reader = ref()
        if reader is None:
            _READERS.remove(ref)
        else:
            reader()


def reset_peak_memory(device: torch.device) -> None:
    """Restart the peaks `peak_memory_mb` reads from what is in use now."""
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def wants_pinned(source: torch.device, target: torch.device) -> bool:
    """Whether a copy from `source` to `target` lands in pinned host memory (a device → host transfer)."""
    return torch.device(target).type == "cpu" and is_cuda(source)


def host_copy(tensor: torch.Tensor, *, pinned: bool) -> torch.Tensor:
    """A copy of a plain (local) tensor in fresh host storage, page-locked when `pinned` (asynchronous device →
    host copies need it). The caller passes a plain tensor: a DTensor's local shard, never the DTensor."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
    return out.copy_(tensor, non_blocking=pinned)


def stream_event(device: torch.device):
    """A CUDA event to record behind work queued on `device`'s current stream (waiting on it waits for that work
    only, not the whole stream); None elsewhere, where queued work is already done."""
    return torch.cuda.Event() if is_cuda(device) else None


class HostReadback:
    """One device value read on the host without waiting for the whole stream: on CUDA `put` copies it
    (non_blocking) into pinned host memory and records an event behind the copy, and `get` waits for that event
    only, so work queued after `put` keeps the device busy meanwhile; elsewhere the value is copied as it is."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.long) -> None:
        self.event = stream_event(device)
        self.host = host_copy(torch.zeros((), dtype=dtype), pinned=self.event is not None)

    def put(self, value: torch.Tensor) -> None:
        self.host.copy_(value, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()

    def get(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.host.numpy())  # a host buffer: read through numpy, no aten::item (a device read's op)


def pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host `tensor` bound for `device`, page-locked when that is a CUDA device (a copy from it to the device is
    then one asynchronous DMA, not a staged copy through a pageable bounce buffer); itself elsewhere or when it is
    pinned already."""
    if is_cuda(device) and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


def to_device(tensor: torch.Tensor, device: torch.device, *, non_blocking: bool = False) -> torch.Tensor:
    """`tensor` on `device`: itself when it is there already (CPU runs, shards already on the GPU), else one copy
    (a host buffer bound for a CUDA collective; `non_blocking` from pinned host memory: queued on the stream)."""
    device = torch.device(device)
    if tensor.device == device or (device.index is None and tensor.device.type == device.type):
        return tensor
    return tensor.to(device, non_blocking=non_blocking)


def rng_states(device: torch.device) -> dict:
    """The random generators of this process that training draws from: the CPU's and, on CUDA, this device's."""
    states = {"torch": torch.get_rng_state()}
    if is_cuda(device):
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    if is_cuda(device) and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


_CAPTURE_STREAMS: dict[str, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device):
    """One side stream per device for every capture, as `torch.cuda.graph` keeps one: graphs that share a memory
    pool reuse each other's freed blocks only when captured on the same stream."""
    key = str(device)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[key]


class StepGraph:
    """`fn()` (a step reading and writing fixed tensors, e.g. the static-shape decode step) as a CUDA graph: on a
    CUDA `device`, warmed up on a side stream (a compiled `fn` compiles there), captured once, then every call
    replays it and returns the outputs of the capture, rewritten in place; elsewhere every call calls `fn`. Graphs
    that share `pool` (`pool()` of the first) take one pool's memory for their intermediates, not one each.
    `device` None: never captured.

    Captured with `CUDAGraph.capture_begin/capture_end` on the side stream, not `torch.cuda.graph`: that context's
    `__enter__` synchronizes the device and empties the caching allocator and the pinned host cache at every
    capture (up to 2·log₂B captures per decode), handing back blocks that the next steps then allocate again."""

    def __init__(self, fn, device: torch.device | None, *, pool=None, warmup: int = 2) -> None:
        self.fn, self.graph, self.out = fn, None, None
        if device is None or not is_cuda(device):
            return
        side, main = _capture_stream(device), torch.cuda.current_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(warmup):  # the step is idempotent: it writes the same keys/values to the same slot
                fn()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            try:
                out = fn()
            finally:
                graph.capture_end()  # after a failed capture too: the stream leaves capture mode
        main.wait_stream(side)
        self.graph, self.out = graph, out

    def pool(self):
        return None if self.graph is None else self.graph.pool()

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out
