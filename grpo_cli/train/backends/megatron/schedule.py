"""Micro-batches through Megatron's pipeline schedule (`get_forward_backward_func`): the GRPO loss of
`train/loss.compute_loss` on the last pipeline stage from vocabulary-parallel logprobs, and no-grad logprobs of a
batch. Results computed on the last stage are broadcast so every rank returns the same."""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from grpo_cli.train.backends.megatron.logprobs import (
    Aligned,
    VocabParallelHead,
    right_aligned,
    vocab_parallel_logprobs,
)
from grpo_cli.train.batch import TrainBatch


def micro_batches(batch: TrainBatch, size: int) -> list[tuple[TrainBatch, Aligned]]:
    out = []
    for start in range(0, len(batch), size):
        mb = batch.rows(start, start + size)
        out.append((mb, right_aligned(mb.input_ids, mb.attention_mask, mb.num_completion_tokens)))
    return out


def _forward(data_iterator, model, *, loss, head: dict):
    """One micro-batch through `model`; on the last stage the output layer runs chunked (`VocabParallelHead`, built
    from `head`'s options) and the loss reads its (B, T, k) statistics, else the (B, S, V/tp) logits."""
    mb, aligned = next(data_iterator)
    stand_in = VocabParallelHead.install(model, aligned, **head)
    with stand_in or contextlib.nullcontext():
        output = model(input_ids=aligned.tokens, position_ids=aligned.positions, attention_mask=None)
    return output, partial(loss, mb, aligned, stand_in)


def completion_logits(output: torch.Tensor, aligned: Aligned) -> torch.Tensor:
    """(b, T, V/tp): the last stage's logits (b, S, V/tp) at the columns predicting the completion tokens."""
    index = aligned.predict_at.unsqueeze(-1).expand(-1, -1, output.shape[-1])
    return output.gather(1, index)


def run_schedule(chunks: list[torch.nn.Module], items: list, loss, *, forward_only: bool, head: dict) -> list:
    """Megatron's schedule for this parallel layout over `items` (one iterator per model chunk); returns what the
    loss function reported per micro-batch (on the last pipeline stage; empty elsewhere). `head`: the options of
    the chunked output layer (`VocabParallelHead`: vocab_size, temperature, with_entropy, entropy_grad)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    width = max(a.tokens.shape[1] for _, a in items)
    rows = max(a.tokens.shape[0] for _, a in items)
    iterators = [iter(items) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=partial(_forward, loss=loss, head=head), data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(items), seq_length=width,
        micro_batch_size=rows, forward_only=forward_only)


def from_last_stage(obj):
    """Collective over the pipeline group: the last stage's `obj` on every stage."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=mpu.get_pipeline_model_parallel_last_rank(),
                                            group=mpu.get_pipeline_model_parallel_group())
    return box[0]


def train_loss(mb: TrainBatch, aligned: Aligned, head: VocabParallelHead | None, output: torch.Tensor, *,
               vocab_size: int, temperature: float, entropy_grad: bool, loss_fn):
    """Megatron's loss function contract: (loss to back-propagate, token count, reported data). The count is not
    used for scaling (`calculate_per_token_loss`: `compute_loss` already scaled the loss)."""
    if head is not None:
        logprobs, entropy = head.split(output)
    else:
        logprobs, entropy = vocab_parallel_logprobs(
            completion_logits(output, aligned), aligned.targets, vocab_size=vocab_size, temperature=temperature,
            with_entropy=True, entropy_grad=entropy_grad)
    loss, metrics = loss_fn(mb, logprobs * aligned.valid, entropy * aligned.valid)
    report = {name: float(value) for name, value in metrics.items()}
    report["__nonfinite__"] = None if torch.isfinite(loss) else float(loss.detach())
    return loss, torch.ones((), dtype=torch.int, device=loss.device), report


def logprob_report(mb: TrainBatch, aligned: Aligned, head: VocabParallelHead | None, output: torch.Tensor, *,
                   vocab_size: int, temperature: float):
    if head is not None:
        logprobs, _ = head.split(output)
    else:
        logprobs, _ = vocab_parallel_logprobs(completion_logits(output, aligned), aligned.targets,
                                              vocab_size=vocab_size, temperature=temperature, with_entropy=False,
                                              entropy_grad=False)
    zero = torch.zeros((), device=output.device)
    return zero, torch.ones((), dtype=torch.int, device=output.device), {"logprobs": (logprobs * aligned.valid).cpu()}
