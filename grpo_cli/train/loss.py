"""Bridge from `AlgorithmConfig` to the pure functions of `grpo_cli.algo`: advantages, loss and mismatch metrics.

No math here: each function unpacks the config sections into the keyword arguments of one algo function.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from grpo_cli.algo.advantages import group_advantages, process_advantages, weighted_rewards
from grpo_cli.algo.aggregation import aggregate_loss
from grpo_cli.algo.importance import off_policy_sequence_mask, rollout_correction
from grpo_cli.algo.kl import kl_penalty
from grpo_cli.algo.metrics import clip_metrics, mismatch_metrics as _mismatch_metrics
from grpo_cli.algo.numerics import as_mask, masked_values, token_mean
from grpo_cli.algo.objectives import policy_objective
from grpo_cli.config.algorithm import AlgorithmConfig

MISMATCH_PREFIX = "rollout_correction/"


def compute_advantages(
    rewards_per_func: Tensor, *, weights: Sequence[float], group_size: int, algorithm: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """(B, F) rewards (NaN = None) -> (advantages (B,), rewards (B,)); rows of a group are contiguous.

    rewards = Σ_f w_f r_f over non-NaN entries (NaN when every function returned None); NaN rewards are left
    out of the group statistics and get advantage 0.
    """
    rewards = weighted_rewards(rewards_per_func, weights)
    advantages = group_advantages(rewards, group_size, **algorithm.advantage.model_dump())
    return advantages, rewards


def compute_process_advantages(
    step_rewards: Tensor, step_ends: Tensor, *, group_size: int, num_tokens: int, algorithm: AlgorithmConfig
) -> Tensor:
    """Step rewards (B, S) (NaN = padding) ending at token indices step_ends (B, S) -> (B, num_tokens) advantages.

    Several process reward functions: combine their step rewards first (same steps), e.g. with
    `weighted_rewards` per step. The result goes to `compute_loss(advantages=...)` as (b, T) advantages.
    """
    return process_advantages(
        step_rewards, step_ends, group_size, num_tokens, **algorithm.advantage.model_dump()
    )


def mismatch_metrics(
    *, old_logprobs: Tensor, sampler_logprobs: Tensor, completion_mask: Tensor, algorithm: AlgorithmConfig
) -> dict[str, Tensor]:
    """The `rollout_correction/...` metrics of one micro-batch (also used by `grpo diagnose-mismatch`)."""
    mask = as_mask(completion_mask)
    correction = rollout_correction(old_logprobs, sampler_logprobs, mask, **algorithm.is_correction.model_dump())
    metrics = _mismatch_metrics(old_logprobs, sampler_logprobs, mask, correction)
    return {MISMATCH_PREFIX + name: value for name, value in metrics.items()}


def trained_mask(completion_mask: Tensor, truncated: Tensor | None, *, algorithm: AlgorithmConfig) -> Tensor:
    """The tokens the loss trains on: the completion mask, without the rows of truncated completions (finish
    reason `length`, (b,) bool) when `algorithm.mask_truncated_completions` is on."""
    mask = as_mask(completion_mask)
    if algorithm.mask_truncated_completions and truncated is not None:
        mask = mask & ~truncated.bool().unsqueeze(1)
    return mask


def compute_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    sampler_logprobs: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    algorithm: AlgorithmConfig,
    num_items_in_batch: float,
    num_sequences_in_batch: int,
    max_completion_length: int,
    entropy: Tensor | None = None,
    truncated: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one micro-batch, scaled so that the sum over the step's micro-batches (all ranks) is the step loss.

    ℓ_t = w_t · keep_i · objective_t + β · KL_t − c · H_t: IS weights w (old vs sampler) and the OPSM keep-mask
    scale the surrogate only; the KL term and the entropy bonus (c = entropy_coef, H = token entropy (b, T))
    are not IS-weighted. old_logprobs None means on-policy (logprobs.detach()). Tokens of `truncated` rows
    leave the loss when mask_truncated_completions is on (`trained_mask`); the mismatch and entropy metrics keep
    them. num_items_in_batch must count the trained tokens. Returns (loss with grad, detached scalar metrics).
    """
    full = as_mask(completion_mask)
    mask = trained_mask(completion_mask, truncated, algorithm=algorithm)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    out = policy_objective(logprobs, old, advantages, mask, **algorithm.objective.model_dump())
    per_token = out.loss
    metrics = {f"clip_ratio/{name}": value for name, value in clip_metrics(out, mask).items()}
    if sampler_logprobs is not None:
        correction = rollout_correction(old, sampler_logprobs, full, **algorithm.is_correction.model_dump())
        per_token = per_token * correction.weights
        mismatch = _mismatch_metrics(old, sampler_logprobs, full, correction)
        metrics.update({MISMATCH_PREFIX + name: value for name, value in mismatch.items()})
    if algorithm.off_policy_sequence_mask_delta is not None:
        behaviour = old if sampler_logprobs is None else sampler_logprobs
        keep = off_policy_sequence_mask(
            logprobs, behaviour, advantages, mask,
            off_policy_sequence_mask_delta=algorithm.off_policy_sequence_mask_delta,
        )
        per_token = per_token * keep.unsqueeze(1).to(per_token.dtype)
        metrics["opsm/masked_frac"] = (~keep).float().mean().detach()
    if algorithm.kl.beta > 0:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl.beta > 0 needs ref_logprobs (the reference model's logprobs)")
        kl = kl_penalty(logprobs, ref_logprobs, mask, **algorithm.kl.model_dump())
        per_token = per_token + kl.penalty
        metrics["kl"] = token_mean(kl.kl, mask).detach()
    if entropy is not None:
        metrics["entropy"] = token_mean(entropy.detach(), full)
        if algorithm.entropy_coef > 0:
            per_token = per_token - algorithm.entropy_coef * masked_values(entropy, mask)
    elif algorithm.entropy_coef > 0:
        raise ValueError("algorithm.entropy_coef > 0 needs the token entropy (completion_logprobs_entropy)")
    loss = aggregate_loss(
        per_token,
        mask,
        aggregation=algorithm.aggregation,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
        max_completion_length=max_completion_length,
    )
    metrics["loss"] = loss.detach()
    return loss, metrics

