"""Loss aggregation: per-token losses of one micro-batch -> its share of the optimizer step's scalar loss.

Every mode is scaled so that summing the micro-batch losses of a step (all micro-batches, all ranks) gives the
step loss; masked-out tokens (IS mask, OPSM) stay in the denominators (they were valid completion tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from grpo_cli.algo.numerics import lengths, masked_values

# (per_token_loss, mask, *, num_items_in_batch, num_sequences_in_batch, max_completion_length) -> scalar.
AggregationFn = Callable[..., Tensor]


def _at_least_one(x: float | Tensor) -> float | Tensor:
    if isinstance(x, Tensor):
        return x.float().clamp(min=1.0)
    return max(float(x), 1.0)


def token_mean(
    per_token_loss: Tensor,
    mask: Tensor,
    *,
    num_items_in_batch: float | Tensor,
    num_sequences_in_batch: int,
    max_completion_length: int,
) -> Tensor:
    """Σ_{i,t} m ℓ / N with N = valid tokens of the whole step (all micro-batches and ranks) — DAPO's
    token-level loss (arXiv:2503.14476 eq. 8)."""
    del num_sequences_in_batch, max_completion_length
    return masked_values(per_token_loss, mask).sum() / _at_least_one(num_items_in_batch)


def token_mean_local(
    per_token_loss: Tensor,
    mask: Tensor,
    *,
    num_items_in_batch: float | Tensor,
    num_sequences_in_batch: int,
    max_completion_length: int,
) -> Tensor:
    """BNPO/TRL `bnpo`: Σ m ℓ / Σ m over this micro-batch, times b / num_sequences_in_batch.

    The factor b / B makes the sum over equal-sized micro-batches the mean of their local token means
    (TRL divides by the gradient-accumulation steps to the same effect).
    """
    del num_items_in_batch, max_completion_length
    local = masked_values(per_token_loss, mask).sum() / mask.float().sum().clamp(min=1.0)
    return local * (mask.shape[0] / _at_least_one(num_sequences_in_batch))


def seq_mean_token_mean(
    per_token_loss: Tensor,
    mask: Tensor,
    *,
    num_items_in_batch: float | Tensor,
    num_sequences_in_batch: int,
    max_completion_length: int,
) -> Tensor:
    """Original GRPO (arXiv:2402.03300 eq. 3): (1/B) Σ_i (1/L_i) Σ_t m ℓ, B = sequences of the step.
    Rows without valid tokens contribute 0 (and still count in B)."""
    del num_items_in_batch, max_completion_length
    per_seq = masked_values(per_token_loss, mask).sum(dim=-1) / lengths(mask).clamp(min=1.0)
    return per_seq.sum() / _at_least_one(num_sequences_in_batch)


def seq_mean_token_sum_norm(
    per_token_loss: Tensor,
    mask: Tensor,
    *,
    num_items_in_batch: float | Tensor,
    num_sequences_in_batch: int,
    max_completion_length: int,
) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): Σ_{i,t} m ℓ / (B · max_completion_length)."""
    del num_items_in_batch
    denominator = _at_least_one(num_sequences_in_batch) * max(int(max_completion_length), 1)
    return masked_values(per_token_loss, mask).sum() / denominator


AGGREGATIONS: dict[str, AggregationFn] = {
    "token_mean": token_mean,
    "token_mean_local": token_mean_local,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}
"""`algorithm.aggregation` registry."""


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    *,
    aggregation: str,
    num_items_in_batch: float | Tensor,
    num_sequences_in_batch: int,
    max_completion_length: int,
) -> Tensor:
    """Scalar micro-batch loss of `aggregation` (see AGGREGATIONS); per_token_loss and mask are (b, T)."""
    fn = AGGREGATIONS[aggregation]
    return fn(
        per_token_loss,
        mask,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
        max_completion_length=max_completion_length,
    )

