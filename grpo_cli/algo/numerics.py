"""Shared numerics of algo/: masks, guarded log-ratios, clamped exp and masked reductions.

Every helper keeps garbage in masked positions out of values AND gradients (torch.where, never multiplication).
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Every exp of a log-ratio clamps its input to ±LOG_RATIO_CLAMP (exp(20) ≈ 4.9e8, finite in fp32)."""


def as_mask(completion_mask: Tensor) -> Tensor:
    """Boolean (b, T) mask from a bool or 0/1 numeric mask."""
    if completion_mask.dtype == torch.bool:
        return completion_mask
    return completion_mask != 0


def safe_exp(log_ratio: Tensor) -> Tensor:
    """exp(clamp(x, -20, 20)) in fp32: the only way algo/ exponentiates a log-ratio."""
    return torch.exp(log_ratio.float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def expm1_minus_identity(x: Tensor) -> Tensor:
    """e^x̂ − x̂ − 1 written expm1(x̂) − x̂, x̂ = min(x, 20), returned in fp32: the k3 form.

    The clamp is on x itself, so past 20 the value is constant and its gradient 0 (not +1, as clamping only
    inside exp would give); for x ≪ 0 it stays exact (expm1 → −1). The subtraction runs in float64: in fp32,
    expm1(x)'s own rounding (~ulp(x)) is 3e-4 of the result at |x| = 1e-4; in float64 it is ~1e-7 (fp32 output).
    """
    x_hat = x.double().clamp(max=LOG_RATIO_CLAMP)
    return (torch.expm1(x_hat) - x_hat).float()


def squared_ratio_minus_one(log_ratio: Tensor) -> Tensor:
    """ρ² − 1 = expm1(2·clamp(x, -20, 20)), fp32, for ρ = e^x: no cancellation when ρ ≈ 1 (χ² metrics)."""
    return torch.expm1(2.0 * log_ratio.float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def masked_values(values: Tensor, mask: Tensor) -> Tensor:
    """fp32 copy of `values` with masked positions replaced by 0 (value and gradient)."""
    values = values.float()
    return torch.where(mask, values, torch.zeros_like(values))


def masked_log_ratio(numerator: Tensor, denominator: Tensor, mask: Tensor, *, name: str) -> Tensor:
    """fp32 `numerator - denominator` on valid positions, 0 elsewhere.

    Raises ValueError naming `name` when a valid position is non-finite: a silent zero would hide a broken
    logprob computation (e.g. a -inf logprob from a token the sampler could not have produced).
    """
    if numerator.shape != denominator.shape or numerator.shape != mask.shape:
        raise ValueError(
            f"{name}: shapes differ: {tuple(numerator.shape)}, {tuple(denominator.shape)}, mask {tuple(mask.shape)}"
        )
    diff = numerator.float() - denominator.float()
    bad = mask & ~torch.isfinite(diff)
    if bool(bad.any()):
        count = int(bad.sum())
        raise ValueError(
            f"{name}: {count} non-finite log-ratio value(s) at valid (unmasked) positions; "
            "check the logprob computation (NaN/inf logprobs, or a token the engine could not have sampled)."
        )
    return torch.where(mask, diff, torch.zeros_like(diff))


def token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """(b,) or (b, T) advantages -> fp32 (b, T), 0 at masked positions; non-finite valid values raise."""
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand_as(mask)
    if adv.shape != mask.shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match mask {tuple(mask.shape)}")
    if bool((mask & ~torch.isfinite(adv)).any()):
        raise ValueError("advantages: non-finite value(s) at valid positions; rewards must be finite or NaN-masked.")
    return torch.where(mask, adv, torch.zeros_like(adv))


def lengths(mask: Tensor) -> Tensor:
    """L_i = Σ_t m_it as fp32 (b,)."""
    return mask.float().sum(dim=-1)


def seq_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Σ_t m_it x_it, fp32 (b,)."""
    return masked_values(values, mask).sum(dim=-1)


def seq_mean(values: Tensor, mask: Tensor) -> Tensor:
    """(1/L_i) Σ_t m_it x_it, fp32 (b,); 0 for rows without valid tokens."""
    return seq_sum(values, mask) / lengths(mask).clamp(min=1.0)


def token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ m x / Σ m over all valid tokens (scalar fp32); 0 when nothing is valid."""
    return masked_values(values, mask).sum() / mask.float().sum().clamp(min=1.0)


def row_mean(values: Tensor, valid_rows: Tensor) -> Tensor:
    """Mean of (b,) values over rows where `valid_rows` (scalar fp32); 0 when no row is valid."""
    return masked_values(values, valid_rows).sum() / valid_rows.float().sum().clamp(min=1.0)


def row_extreme(values: Tensor, valid_rows: Tensor, *, largest: bool) -> Tensor:
    """Max (or min) of (b,) values over valid rows (scalar fp32); 0 when no row is valid."""
    fill = torch.full_like(values.float(), float("-inf") if largest else float("inf"))
    picked = torch.where(valid_rows, values.float(), fill)
    extreme = picked.max() if largest else picked.min()
    return torch.where(valid_rows.any(), extreme, torch.zeros_like(extreme))
