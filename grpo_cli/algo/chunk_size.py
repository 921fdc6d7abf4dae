"""How many positions the chunked output layer (`algo.chunked_logprobs`) projects at a time; torch-free, so that
`grpo plan` (config/) sizes the same chunk the trainer builds."""

from __future__ import annotations

CHUNK_ELEMENTS = 1 << 24
"""Logits elements per chunk (64 MB in float32): rows per chunk = this // vocabulary, so the peak is a few such
buffers (the chunk's logits, softmax and their gradient) whatever the batch, length or vocabulary."""

CHUNK_BUFFERS = 3
"""(n, V) float32 buffers of one chunk alive at once at most: its logits (turned into log p in place), their exp,
and the `p == 0` mask / the gradient written over the logits."""


def rows_per_chunk(vocab: int, elements: int) -> int:
    """Positions per chunk for a vocabulary (or vocabulary shard) of `vocab` entries and `elements` logits per chunk
    (`CHUNK_ELEMENTS` in the trainer): elements // vocab, at least 1."""
    return max(1, elements // max(1, vocab))
