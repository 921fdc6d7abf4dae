"""What a weight sync reads from the trainer (`WeightSource`): full tensors under Hugging Face checkpoint names, a few
names worth checking, and the trainer's own logprobs of probe sequences. Each training backend provides one
(`TrainingBackend.weight_source`): a Hugging Face module's (`hf_module.ModuleWeights`) or megatron's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

CHECKSUM_TENSORS = 4
SAMPLED_ROWS = 8
"""Rows of the embedding and output projection kept at each verified sync, read back when a check fails."""


class WeightSource(Protocol):
    dtype: torch.dtype
    """The dtype of the weights the trainer holds (float32 masters under mixed precision by default)."""
    compute_dtype: torch.dtype
    """The dtype `probe_logprobs` computes in, `model.dtype` under mixed precision (with the engine's dtype, it
    bounds how closely the probe logprobs agree: DESIGN.md 4b)."""

    def named_tensors(self, *, bucket_mb: int, stats: dict, keep_copies: set[str], keep_rows: set[str],
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: `(checkpoint name, full tensor)` of every weight, gathered `bucket_mb` at a time; each
        recorded with `record_sent`. `dtype`: the engine's, which a source may cast to before it gathers (the
        caller casts what comes out in another dtype)."""

    def checksum_names(self) -> list[str]:
        """A few small weights to read back from the engine for exact equality."""

    def projection_names(self) -> list[str]:
        """Checkpoint names of the input embedding and the output projection."""

    def probe_logprobs(self, probe: list[list[int]], vision=None) -> list[list[float]]:
        """Collective: the trainer's temperature-1 logprob of every token after the first of each sequence, computed
        as the trainer's forward computes (in `compute_dtype`); `vision`: the sequences' images
        (`models.vision.VisionInputs`, vision-language models only)."""

    def describe_ties(self) -> str | None:
        """One line naming the tied weights a sync sends under several names, or None."""


def record_sent(stats: dict, name: str, tensor: torch.Tensor, *, keep_copies: set[str], keep_rows: set[str]) -> None:
    """Count a streamed tensor into `stats` ("tensors", "bytes"); keep a CPU copy in `stats["copies"]` when `name` is
    in `keep_copies`, and (shape, first `SAMPLED_ROWS` rows) in `stats["rows"]` when it is in `keep_rows`."""
    stats["tensors"] += 1
    stats["bytes"] += tensor.numel() * tensor.element_size()
    if name in keep_copies:
        stats["copies"][name] = tensor.to("cpu", copy=True)
    if name in keep_rows:
        stats.setdefault("rows", {})[name] = (tuple(tensor.shape), tensor[:SAMPLED_ROWS].to("cpu", copy=True))


def spread(names: list[str], count: int = CHECKSUM_TENSORS) -> list[str]:
    """`count` of `names` evenly spaced from the first to the last (all of them when there are no more)."""
    if len(names) <= count:
        return names
    return [names[round(i * (len(names) - 1) / (count - 1))] for i in range(count)]
