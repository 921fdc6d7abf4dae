"""The megatron backend as a weight-sync source (`weights.source.WeightSource`): full Hugging Face-named tensors from
its bucketed gather (`export.hf_tensor_buckets`), probe logprobs from its own pipeline schedule, and the names worth
reading back taken from the checkpoint the run started from (the export writes the same names)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
import torch

from grpo_cli.models.checkpoint_files import stored_shapes
from grpo_cli.train.backends.base import compute_dtype
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.weights.source import record_sent, spread


def probe_batch(sequences: list[list[int]], *, pad_token_id: int) -> TrainBatch:
    """Probe sequences as a batch whose prompt is each one's first token and whose completion is the rest
    (right-padded), so completion logprobs are the logprobs of every token after the first."""
    from grpo_cli.models.logprobs import right_padded

    ids, mask = right_padded(sequences, pad_token_id=pad_token_id)
    return TrainBatch(ids, mask, mask[:, 1:].float())


class MegatronWeights:
    """`WeightSource` of a `MegatronBackend` (every method that gathers or runs the model is collective)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.dtype = next(backend.model.parameters()).dtype
        self.compute_dtype = compute_dtype(backend.cfg)  # probe_logprobs runs batch_logprobs, in model.dtype

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return stored_shapes(self.backend.model_path)

    def named_tensors(self, *, bucket_mb: int, stats: dict, keep_copies: set[str], keep_rows: set[str],
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """`dtype` is not used: the gather reads the compute-dtype model chunks (`weight_sync.cast_stream` casts)."""
        for bucket in self.backend.hf_tensor_buckets(bucket_mb=bucket_mb):
            for name, tensor in bucket:
                record_sent(stats, name, tensor, keep_copies=keep_copies, keep_rows=keep_rows)
                yield name, tensor

    def checksum_names(self) -> list[str]:
        return spread([n for n, shape in self._shapes.items() if len(shape) == 1])

    def projection_names(self) -> list[str]:
        """The (vocabulary × hidden) matrices: the input embedding and an untied output projection."""
        vocab = self.backend.vocab_size
        return [n for n, shape in self._shapes.items() if len(shape) == 2 and shape[0] == vocab]

    def probe_logprobs(self, probe: list[list[int]]) -> list[list[float]]:
        lp = self.backend.batch_logprobs(probe_batch(probe, pad_token_id=0).to(self.backend.device),
                                         micro_batch_size=len(probe), temperature=1.0)
        return [lp[i, :len(s) - 1].tolist() for i, s in enumerate(probe)]

    def describe_ties(self) -> str | None:
        """None: the gather sends a tied embedding once, under its own name."""
        return None
