"""Named tensors as one flat byte buffer and a layout: how async mode ships weights through Ray's object store.

One contiguous uint8 buffer goes into the object store with a single copy (numpy, zero-copy on the way out);
a dict of tensors is pickled tensor by tensor and measured 3-4x slower (5M-parameter model: 38-58 ms vs 14 ms).
Layout entries are (name, dtype name, shape, byte offset), offsets 16-byte aligned; any dtype works (bf16 has no
numpy twin, bytes do).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator

import torch

ALIGN = 16
"""Byte alignment of each tensor in the buffer (≥ the largest element size)."""


def flatten(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, str, tuple[int, ...], int]], object]:
    """(layout, numpy uint8 array) of the tensors, moved to the CPU and laid end to end."""
    layout, parts, offset = [], [], 0
    for name, tensor in named:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if offset % ALIGN:  # every tensor starts aligned, so its bytes can be viewed as its dtype
            parts.append(torch.zeros(ALIGN - offset % ALIGN, dtype=torch.uint8))
            offset += ALIGN - offset % ALIGN
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        parts.append(flat)
        offset += flat.numel()
    buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return layout, buffer.numpy()


def unflatten(layout: list[tuple[str, str, tuple[int, ...], int]], buffer) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `flatten`, as views of `buffer` (read-only when it lives in the object store:
    copy before writing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": the views are only read
        data = torch.from_numpy(buffer)
    for name, dtype, shape, offset in layout:
        dt = getattr(torch, dtype)
        count = 1
        for d in shape:
            count *= d
        nbytes = count * torch.empty((), dtype=dt).element_size()
        yield name, data[offset : offset + nbytes].view(dt).reshape(shape)


def byte_buckets(named: Iterable[tuple[str, torch.Tensor]], cap_bytes: int,
                 nbytes: Callable[[torch.Tensor], int] = lambda t: t.numel() * t.element_size()) -> Iterator[list]:
    """Consecutive groups of (name, tensor) whose `nbytes` sum stays under `cap_bytes` (a larger tensor is a group
    of its own), taken lazily from `named`."""
    bucket, size = [], 0
    for name, tensor in named:
        n = nbytes(tensor)
        if bucket and size + n > cap_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket
