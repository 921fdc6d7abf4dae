"""One optimizer step over micro-batches: forward, loss, backward (no DDP sync until the last), clip, step."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.rollout.scoring import completion_logprobs, completion_logprobs_entropy
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.loss import compute_loss
from grpo_cli.train.policy import Policy


def forward_logprobs(model, mb: TrainBatch, *, temperature: float) -> torch.Tensor:
    """Completion-token logprobs (b, T) of a micro-batch, in fp32."""
    return completion_logprobs(
        model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.num_completion_tokens, temperature=temperature
    )


@torch.no_grad()
def batch_logprobs(model, batch: TrainBatch, *, micro_batch_size: int, temperature: float) -> torch.Tensor:
    """No-grad logprobs (B, T) of the whole batch (old-policy or reference pass)."""
    parts = [
        forward_logprobs(model, batch.rows(i, i + micro_batch_size), temperature=temperature)
        for i in range(0, len(batch), micro_batch_size)
    ]
    return torch.cat(parts)


class NonFiniteStep(Exception):
    """The loss or gradient was not finite; the optimizer step was skipped."""


def optimizer_step(policy: Policy, batch: TrainBatch, cfg: GRPOConfig, *, num_items: float,
                   num_sequences: int, world_size: int = 1) -> dict[str, float]:
    """Accumulate gradients over micro-batches of `batch` (already on device), clip, step, schedule.

    Each micro-batch loss is scaled by `compute_loss` so that the sum over micro-batches and ranks is the whole
    step's loss; DDP averages gradients over ranks, so the backward pass uses loss × world_size to make that
    average the gradient of the sum. DDP all-reduces gradients only on the last micro-batch. Raises `NonFiniteStep` (gradients zeroed, no step) on NaN/inf.
    """
    micro = cfg.train.micro_batch_size
    starts = list(range(0, len(batch), micro))
    sums: dict[str, float] = defaultdict(float)
    policy.optimizer.zero_grad(set_to_none=True)
    for k, start in enumerate(starts):
        mb = batch.rows(start, start + micro)
        last = k == len(starts) - 1
        sync = contextlib.nullcontext() if last or not hasattr(policy.model, "no_sync") else policy.model.no_sync()
        with sync:
            logprobs, entropy = completion_logprobs_entropy(
                policy.model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.num_completion_tokens,
                temperature=cfg.rollout.temperature, entropy_grad=cfg.algorithm.entropy_coef > 0,
            )
            loss, metrics = compute_loss(
                logprobs=logprobs, old_logprobs=mb.old_logprobs, ref_logprobs=mb.ref_logprobs,
                sampler_logprobs=mb.sampler_logprobs, advantages=mb.advantages, completion_mask=mb.completion_mask,
                algorithm=cfg.algorithm, num_items_in_batch=num_items, num_sequences_in_batch=num_sequences,
                max_completion_length=cfg.rollout.max_completion_length, entropy=entropy, truncated=mb.truncated,
            )
            if not torch.isfinite(loss):
                policy.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteStep(f"non-finite loss {loss.item()}")
            (loss * world_size if world_size > 1 else loss).backward()
        for name, value in metrics.items():
            sums[name] += float(value)
    out = {name: (v if name == "loss" else v / len(starts)) for name, v in sums.items()}
    clip_to = cfg.train.max_grad_norm if cfg.train.max_grad_norm is not None else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.module.parameters(), clip_to))
    if not math.isfinite(grad_norm):
        policy.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteStep(f"non-finite gradient norm {grad_norm}")
    policy.optimizer.step()
    policy.scheduler.step()
    out["grad_norm"] = grad_norm
    out["learning_rate"] = policy.scheduler.get_last_lr()[0]
    return out
