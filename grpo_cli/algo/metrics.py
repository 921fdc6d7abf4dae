"""Detached diagnostics: clip fractions of the objective and training–inference mismatch metrics.

Definitions follow verl's rollout_corr helper / ms-swift (see DESIGN.md §5); all are over valid tokens only,
and every metric is 0 when the micro-batch has no valid token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_cli.algo.importance import Correction
from grpo_cli.algo.numerics import (
    expm1_minus_identity,
    masked_values,
    row_extreme,
    row_mean,
    safe_exp,
    seq_mean,
    seq_sum,
    squared_ratio_minus_one,
    token_mean,
)
from grpo_cli.algo.objectives import ObjectiveOutput


def clip_metrics(output: ObjectiveOutput, mask: Tensor) -> dict[str, Tensor]:
    """Fractions of valid tokens the objective clipped (its `low_clipped`/`high_clipped`), region_mean = either.

    clip/gspo (TRL/ms-swift definitions): low = r < 1−ε_low ∧ A < 0, high = r > 1+ε_high ∧ A > 0. CISPO counts
    the clipped weights, whatever A: high = r > 1+ε_high, low = r < 1 − cispo_epsilon_low (0 without it).
    """
    low, high = output.low_clipped.float(), output.high_clipped.float()
    return {
        "low_mean": token_mean(low, mask).detach(),
        "high_mean": token_mean(high, mask).detach(),
        "region_mean": token_mean(torch.maximum(low, high), mask).detach(),
    }


def _ess(weights: Tensor, valid: Tensor) -> Tensor:
    """Normalised Kish effective sample size (Σw)² / (N Σw²) = mean(w)² / mean(w²) ∈ [0, 1]; 0 if Σw² = 0."""
    w = masked_values(weights, valid)
    n = valid.float().sum().clamp(min=1.0)
    mean_w, mean_w2 = w.sum() / n, (w * w).sum() / n
    return torch.where(mean_w2 > 0, mean_w * mean_w / mean_w2.clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def _sequence_metrics(old: Tensor, sampler: Tensor, log_rho: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Perplexities, log-ppl differences and sequence χ² (means over sequences with ≥ 1 valid token)."""
    rows = mask.any(dim=-1)
    train_nll, rollout_nll = -seq_mean(old, mask), -seq_mean(sampler, mask)
    diff = train_nll - rollout_nll  # = mean_t sampler − mean_t old = log(PPL_train / PPL_rollout)
    return {
        # exp(nll) is capped at e^20 like every exp here, so a garbage-but-finite logprob cannot give inf.
        "training_ppl": row_mean(safe_exp(train_nll), rows),
        "training_log_ppl": row_mean(train_nll, rows),
        "rollout_ppl": row_mean(safe_exp(rollout_nll), rows),
        "rollout_log_ppl": row_mean(rollout_nll, rows),
        "log_ppl_diff": row_mean(diff, rows),
        "log_ppl_abs_diff": row_mean(diff.abs(), rows),
        "log_ppl_diff_max": row_extreme(diff, rows, largest=True),
        "log_ppl_diff_min": row_extreme(diff, rows, largest=False),
        "ppl_ratio": row_mean(safe_exp(diff), rows),
        "chi2_seq": row_mean(squared_ratio_minus_one(seq_sum(log_rho, mask)), rows),
        "chi2_seq_geo": row_mean(squared_ratio_minus_one(seq_mean(log_rho, mask)), rows),
    }


def mismatch_metrics(
    old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, correction: Correction
) -> dict[str, Tensor]:
    """Training–inference mismatch metrics (unprefixed names; callers log them under `rollout_correction/`).

    log ρ = old − sampler (from `correction`, validated finite). Token means over valid tokens:
    kl = mean(sampler − old) (k1 of KL(μ‖π)); k3_kl = mean(ρ − log ρ − 1), computed expm1(x̂) − x̂ with
    x̂ = min(log ρ, 20); chi2_token = mean(ρ²) − 1 = mean(expm1(2 log ρ)) (log ρ clamped to ±20);
    is_weight_mean = mean(w); clipped_frac = mean(1[out of bounds]); ess = (Σw)²/(N Σw²) over tokens.
    Over sequences: training/rollout ppl = mean_i exp(−mean_t logp) and log_ppl = mean_i(−mean_t logp);
    log_ppl_diff_i = mean_t sampler − mean_t old (mean, |·| mean, max, min), ppl_ratio = mean_i exp(diff_i);
    chi2_seq = mean_i expm1(2 Σ_t log ρ) (product), chi2_seq_geo = mean_i expm1(2 mean_t log ρ) (sums ±20);
    ess_seq over the per-sequence mean weight. w = correction.proposed: with correction off they describe the
    correction the config would apply. Inputs (b, T); returns detached fp32 scalars.
    """
    log_rho = correction.log_rho
    old = masked_values(old_logprobs.detach(), mask)
    sampler = masked_values(sampler_logprobs.detach(), mask)
    rows = mask.any(dim=-1)
    metrics = {
        "kl": token_mean(-log_rho, mask),
        "k3_kl": token_mean(expm1_minus_identity(log_rho), mask),
        "chi2_token": token_mean(squared_ratio_minus_one(log_rho), mask),
        "is_weight_mean": token_mean(correction.proposed, mask),
        "clipped_frac": token_mean(correction.out_of_bounds.float(), mask),
        "ess": _ess(correction.proposed, mask),
        "ess_seq": _ess(seq_mean(correction.proposed, mask), rows),
        **_sequence_metrics(old, sampler, log_rho, mask),
    }
    return {name: value.detach().float() for name, value in metrics.items()}
