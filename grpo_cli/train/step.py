"""One optimizer step over micro-batches: forward, loss, backward (gradient reduction on the last), clip, step."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.train.backends.base import NonFiniteStep
from grpo_cli.train.batch import TrainBatch, batch_logprobs, forward_logprobs
from grpo_cli.train.loss import compute_loss
from grpo_cli.train.policy import Policy

__all__ = ["NonFiniteStep", "batch_logprobs", "forward_logprobs", "optimizer_step"]


def optimizer_step(policy: Policy, batch: TrainBatch, cfg: GRPOConfig, *, num_items: float,
                   num_sequences: int, inject_nonfinite: bool = False) -> dict[str, float]:
    """Accumulate gradients over micro-batches of `batch` (already on device), clip, step, schedule.

    Each micro-batch loss is scaled by `compute_loss` so that the sum over micro-batches and ranks is the whole
    step's loss; the backend's `forward_backward` turns its rank-averaged gradients into the gradient of that sum.
    Raises `NonFiniteStep` (gradients zeroed, no step) on NaN/inf, on every rank together. `inject_nonfinite`
    (`GRPO_INJECT_FAULT=nonfinite_loss:...`): this rank's loss is NaN, as an overflow in it would make it.
    """
    backend = policy.backend

    def loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        loss, metrics = compute_loss(
            logprobs=logprobs, old_logprobs=mb.old_logprobs, ref_logprobs=mb.ref_logprobs,
            sampler_logprobs=mb.sampler_logprobs, advantages=mb.advantages, completion_mask=mb.completion_mask,
            algorithm=cfg.algorithm, num_items_in_batch=num_items, num_sequences_in_batch=num_sequences,
            max_completion_length=cfg.rollout.max_completion_length, entropy=entropy, truncated=mb.truncated,
        )
        return (loss * math.nan if inject_nonfinite else loss), metrics

    backend.zero_grad()
    per_micro = backend.forward_backward(batch, micro_batch_size=cfg.train.micro_batch_size,
                                         temperature=cfg.rollout.temperature,
                                         entropy_grad=cfg.algorithm.entropy_coef > 0, loss_fn=loss_fn)
    sums: dict[str, float] = defaultdict(float)
    for metrics in per_micro:
        for name, value in metrics.items():
            sums[name] += float(value)
    out = {name: (v if name == "loss" else v / len(per_micro)) for name, v in sums.items()}
    out["grad_norm"] = backend.clip_and_step()
    out["learning_rate"] = backend.learning_rate()
    return out
