"""How many positions the chunked output layer (`algo.chunked_logprobs`) projects at a time, by device; torch-free,
so that `grpo plan` (config/) sizes the same chunk the trainer builds."""

from __future__ import annotations

CPU_CHUNK_ELEMENTS = 1 << 24
"""Logits elements per chunk on the CPU (64 MB in float32): rows per chunk = this // vocabulary, so the peak is a few
such buffers (the chunk's logits, softmax and their gradient) whatever the batch, length or vocabulary."""

CUDA_CHUNK_ELEMENTS = 1 << 28
"""Logits elements per chunk on CUDA (1 GiB in float32; 1,766 positions at Qwen's 151,936, so 5 chunks for 8,192
positions). The head's backward reads and writes the (V, H) weight gradient once per chunk, a memory-bound pass:
at the CPU's 2^24 (110 positions, 75 chunks) that re-reading cost an estimated +35% (7B) to +130% (0.5B) of the rest
of an H100's train phase, while the GEMMs of a chunk this size keep the GPU busy."""

CHUNK_BUFFERS = 3
"""(n, V) float32 buffers of one chunk counted by `grpo plan`, an upper bound: the forward holds the logits and
`torch.logsumexp`'s temporary (the entropy is written over the logits; a vocabulary shard's forward, the logits
alone); the backward the recomputed logits, turned
into their gradient in place, plus, when the entropy carries a gradient, their exp and a `p == 0` mask (2¼ buffers,
the most of any phase; `tests/algo/test_chunked_head.py` counts the backward's)."""


def chunk_elements(device: str) -> int:
    """Logits elements per chunk on a device of type `device` ("cuda", "cpu", …): `CUDA_CHUNK_ELEMENTS` on CUDA,
    `CPU_CHUNK_ELEMENTS` on anything else (the CPU's memory figures in docs/benchmarks.md are measured at it)."""
    return CUDA_CHUNK_ELEMENTS if device == "cuda" else CPU_CHUNK_ELEMENTS


def rows_per_chunk(vocab: int, elements: int) -> int:
    """Positions per chunk for a vocabulary (or vocabulary shard) of `vocab` entries and `elements` logits per chunk:
    elements // vocab, at least 1."""
    return max(1, elements // max(1, vocab))


def chunk_rows(vocab: int, *, device: str) -> int:
    """Positions per chunk for a vocabulary (or shard) of `vocab` entries on a device of type `device`: what the
    trainer's chunked heads use (the device their hidden states are on) and `grpo plan` counts (its plan's device)."""
    return rows_per_chunk(vocab, chunk_elements(device))


def chunk_bytes(vocab: int, positions: int, *, device: str) -> int:
    """Bytes of one chunk's float32 buffers (`CHUNK_BUFFERS` of them) for a micro-batch of `positions` positions
    over a vocabulary (or tensor-parallel shard) of `vocab` entries on a device of type `device`: `grpo plan`'s head
    row."""
    return split_chunk_bytes(vocab, positions, 1, device=device)


def split_chunk_bytes(vocab: int, positions: int, shards: int, *, device: str) -> int:
    """`chunk_bytes` of the sequence-parallel vocabulary-parallel head (`models.vocab_parallel`): a chunk holds the
    whole vocabulary's rows, min(positions, `chunk_rows(vocab)`), over ⌈vocab/shards⌉ columns."""
    return min(positions, chunk_rows(vocab, device=device)) * -(-vocab // shards) * 4 * CHUNK_BUFFERS
