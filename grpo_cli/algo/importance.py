"""Training–inference mismatch correction: IS weights ρ = π_old / π_sampler (level × action × bounds) and the
DeepSeek-V3.2 off-policy sequence mask. Everything here is detached: it weights the surrogate, never trains.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_cli.algo.numerics import masked_log_ratio, safe_exp, seq_mean, seq_sum, token_advantages

# (log ρ (b, T) fp32, 0 where masked; mask) -> log-weight (b, T), sequence levels broadcast over tokens.
ISLevelFn = Callable[[Tensor, Tensor], Tensor]
# (raw weight (b, T), *, threshold, lower) -> (bounded weight, out-of-bounds bool), both (b, T).
ISActionFn = Callable[..., tuple[Tensor, Tensor]]


def _token_level(log_rho: Tensor, mask: Tensor) -> Tensor:
    """Token TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL"): log ρ_t."""
    del mask
    return log_rho


def _sequence_product(log_rho: Tensor, mask: Tensor) -> Tensor:
    """Σ_t m log ρ_t: the exact sequence likelihood ratio (TRL `sequence_*`, verl `sequence`)."""
    return seq_sum(log_rho, mask).unsqueeze(1).expand_as(log_rho)


def _sequence_geometric(log_rho: Tensor, mask: Tensor) -> Tensor:
    """(1/L_i) Σ_t m log ρ_t: geometric mean of token ratios (ms-swift `sequence_*`, GSPO-style)."""
    return seq_mean(log_rho, mask).unsqueeze(1).expand_as(log_rho)


IS_LEVELS: dict[str, ISLevelFn] = {
    "token": _token_level,
    "sequence_product": _sequence_product,
    "sequence_geometric": _sequence_geometric,
}
"""`is_correction.level` registry."""


def _truncate(raw: Tensor, *, threshold: float, lower: float | None) -> tuple[Tensor, Tensor]:
    """clamp(w, lower, threshold); without `lower` only the upper side is clamped (TIS)."""
    out = raw > threshold
    if lower is not None:
        out = out | (raw < lower)
    return raw.clamp(min=lower, max=threshold), out


def _mask(raw: Tensor, *, threshold: float, lower: float | None) -> tuple[Tensor, Tensor]:
    """w · 1[lower ≤ w ≤ threshold], lower defaulting to 1/threshold (MIS / IcePop)."""
    low = 1.0 / threshold if lower is None else lower
    out = (raw < low) | (raw > threshold)
    return torch.where(out, torch.zeros_like(raw), raw), out


IS_ACTIONS: dict[str, ISActionFn] = {"truncate": _truncate, "mask": _mask}
"""`is_correction.action` registry."""


class Correction(NamedTuple):
    """IS weights, all fp32 (b, T), detached; 1 at masked positions (they never contribute)."""

    weights: Tensor
    """What multiplies the per-token surrogate: `proposed` when enabled, else 1."""
    proposed: Tensor
    """The weights the configured level/action/bounds give (also logged when correction is off)."""
    out_of_bounds: Tensor
    """bool: the raw weight lay outside the bounds (was truncated or masked)."""
    log_rho: Tensor
    """log ρ_t = old − sampler, fp32, 0 at masked positions."""


def rollout_correction(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    *,
    enabled: bool,
    level: str,
    action: str,
    threshold: float,
    lower: float | None,
) -> Correction:
    """IS weights for the training–inference mismatch, ρ_t = exp(old_t − sampler_t).

    level: token ρ_t | sequence_product exp(Σ_t m log ρ_t) | sequence_geometric exp(mean_t log ρ_t), each
    log-weight clamped to ±20 before exp; action: truncate (clamp to [lower, threshold], lower optional) |
    mask (zero outside [lower or 1/threshold, threshold]). Inputs (b, T); a sequence weight is broadcast
    over its tokens. Non-finite log ρ at a valid position raises ValueError.
    """
    log_rho = masked_log_ratio(
        old_logprobs.detach(), sampler_logprobs.detach(), mask, name="old_logprobs - sampler_logprobs"
    )
    raw = safe_exp(IS_LEVELS[level](log_rho, mask))
    bounded, out = IS_ACTIONS[action](raw, threshold=threshold, lower=lower)
    ones = torch.ones_like(bounded)
    proposed = torch.where(mask, bounded, ones)
    weights = proposed if enabled else ones
    return Correction(weights=weights, proposed=proposed, out_of_bounds=out & mask, log_rho=log_rho)


def sequence_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """(b,) advantages as given, or the masked mean over tokens of (b, T) advantages (ms-swift's choice)."""
    return seq_mean(token_advantages(advantages, mask), mask)


def off_policy_sequence_mask(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    off_policy_sequence_mask_delta: float | None,
) -> Tensor:
    """Keep-mask (b,) bool of DeepSeek-V3.2's off-policy sequence masking (DeepSeek-V3.2 report, 2025, eq. 9).

    δ_i = (1/L_i) Σ_t m (behaviour_t − sg(logprobs_t)); sequence i is dropped iff A_i < 0 and δ_i > τ
    (τ = off_policy_sequence_mask_delta; None keeps everything). behaviour = sampler logprobs when the engine
    reports them, else old logprobs (TRL/ms-swift). Advantages (b,) or (b, T) (token mean used).
    """
    keep = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    if off_policy_sequence_mask_delta is None:
        return keep
    diff = masked_log_ratio(behaviour_logprobs.detach(), logprobs.detach(), mask, name="behaviour - logprobs")
    delta = seq_mean(diff, mask)
    drop = (sequence_advantages(advantages, mask) < 0) & (delta > off_policy_sequence_mask_delta)
    return keep & ~drop
