"""glibc heap settings for training on CPU: large tensors come from mmap and go back to the OS when freed.

FSDP2 and ZeRO-3 gather and free every layer's full parameters and gradients at each step; with glibc's dynamic
mmap threshold those buffers land in the heap after the first large free and stay resident as fragments. Measured
on the 50M benchmark model, 2 gloo ranks, 3 AdamW steps, peak RSS per rank: fsdp2 1512 → 994 MB, ZeRO-3
1479 → 1303 MB with a fixed 1 MiB threshold (ddp: 1475 MB either way); the default `grpo train` ran 47 vs 50 s
(noise) with it. ddp on CPU sets a 16 MiB threshold since issue 37: at Qwen's 151,936-token vocabulary the hf
engine's decode allocates (rows × vocabulary) float32 buffers of ~19 MB every step (under glibc's 32 MB ceiling of
the dynamic threshold) and the chunked head 64 MB ones; the 3-step run of the 2-layer benchmark model (P 8 × G 4,
T 128) peaked at 1,984 MB with it (2,087 MB without, in a 2-step profile; 1,869 MB at 1 MiB, which made small
models' training 1.75× slower: `VOCAB_THRESHOLD`).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
SHARDED_THRESHOLD = 1 << 20
"""fsdp2 and ZeRO-3 on CPU: every gathered layer (MBs) comes from mmap and goes back when freed."""
VOCAB_THRESHOLD = 16 << 20
"""ddp on CPU: only vocabulary-sized buffers (the decode's 19 MB, the chunked head's 64 MB at 151,936 tokens) come
from mmap. At 1 MiB every activation did too, and the page faults of mapping them afresh at each allocation made
the train phase of the 0.3M benchmark model (P 16 × G 8, T 64) 1.75× slower (0.667 vs 0.382 s)."""


def return_large_frees_to_os(threshold: int) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process, and its trim threshold at twice that (the
    ratio glibc's own dynamic threshold keeps): True when glibc took them."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
