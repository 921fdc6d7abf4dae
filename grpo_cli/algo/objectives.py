"""Per-token policy objectives: PPO clip (+ clip-higher, dual clip), GSPO, GSPO-token, CISPO.

Each returns per-token losses (0 at masked positions) and clip indicators; aggregation is a separate step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_cli.algo.numerics import masked_log_ratio, masked_values, safe_exp, seq_mean, token_advantages


class ObjectiveOutput(NamedTuple):
    """Per-token loss ℓ (b, T) fp32 with grad (0 where masked) and bool (b, T) clip indicators."""

    loss: Tensor
    low_clipped: Tensor
    """ratio < 1 − ε_low with A < 0 (the lower clip bound is active)."""
    high_clipped: Tensor
    """ratio > 1 + ε_high with A > 0 (the upper clip bound is active)."""


# (logprobs, log_ratio, advantages, mask, *, epsilon_low, epsilon_high, dual_clip_c, cispo_epsilon_low)
# -> ObjectiveOutput. Inputs are already validated: logprobs and log-ratio fp32 and 0 where masked (logprobs with
# grad), advantages (b, T) fp32 and 0 where masked.
ObjectiveFn = Callable[..., ObjectiveOutput]


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, mask: Tensor, *, epsilon_low: float, epsilon_high: float, dual_clip_c: float | None
) -> ObjectiveOutput:
    """ℓ = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A); dual clip: ℓ = min(ℓ, −c·A) where A < 0."""
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    loss = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip_c * adv), loss)
    r = ratio.detach()
    low = mask & (r < 1.0 - epsilon_low) & (adv < 0)
    high = mask & (r > 1.0 + epsilon_high) & (adv > 0)
    return ObjectiveOutput(masked_values(loss, mask), low, high)


def clip_objective(
    logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, epsilon_low: float, epsilon_high: float,
    dual_clip_c: float | None, cispo_epsilon_low: float | None,
) -> ObjectiveOutput:
    """PPO clipped surrogate per token, r_t = exp(logp_t − old_t) (Schulman et al. 2017, arXiv:1707.06347).

    Clip-higher ε_high ≠ ε_low from DAPO (arXiv:2503.14476); dual clip c > 1 from Ye et al. 2020
    (arXiv:1912.09729). log_ratio, adv, mask: (b, T).
    """
    del logprobs, cispo_epsilon_low
    ratio = safe_exp(log_ratio)
    return _clipped_surrogate(
        ratio, adv, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high, dual_clip_c=dual_clip_c
    )


def gspo_objective(
    logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, epsilon_low: float, epsilon_high: float,
    dual_clip_c: float | None, cispo_epsilon_low: float | None,
) -> ObjectiveOutput:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): the clipped surrogate with the sequence ratio
    s_i = exp((1/L_i) Σ_t m (logp − old)) (geometric mean of token ratios) broadcast to every token of i."""
    del logprobs, cispo_epsilon_low
    seq_ratio = safe_exp(seq_mean(log_ratio, mask)).unsqueeze(1).expand_as(log_ratio)
    return _clipped_surrogate(
        seq_ratio, adv, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high, dual_clip_c=dual_clip_c
    )


def gspo_token_objective(
    logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, epsilon_low: float, epsilon_high: float,
    dual_clip_c: float | None, cispo_epsilon_low: float | None,
) -> ObjectiveOutput:
    """GSPO-token (arXiv:2507.18071): s_it = sg(s_i) · exp(log_ratio_t − sg(log_ratio_t)).

    Same value as GSPO's s_i, but each token's gradient is its own ∇logp_t scaled by s_i, so token-level
    advantages A_it can be used.
    """
    del logprobs, cispo_epsilon_low
    seq_log = seq_mean(log_ratio, mask).detach().unsqueeze(1)
    token_ratio = safe_exp(seq_log + log_ratio - log_ratio.detach())
    return _clipped_surrogate(
        token_ratio, adv, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high, dual_clip_c=dual_clip_c
    )


def cispo_objective(
    logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, epsilon_low: float, epsilon_high: float,
    dual_clip_c: float | None, cispo_epsilon_low: float | None,
) -> ObjectiveOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585 eq. 4): ℓ_t = −sg(w_t) · A · log π_θ(y_t), w_t = min(r_t, 1 + ε_high).

    Gradient flows through every token (the weight, not the token, is clipped): ∇ℓ_t = −w_t·A·∇logp_t. As
    published (TRL and ms-swift agree) there is no lower clamp; with cispo_epsilon_low set the weight is
    max(w_t, 1 − cispo_epsilon_low) (slime/NeMo style). epsilon_low and dual_clip_c are not used (the config
    refuses them). Clip indicators mark what is clipped, whatever the sign of A: high = r > 1 + ε_high,
    low = r < 1 − cispo_epsilon_low (TRL's cispo_clip_ratio also requires A > 0). Bounds are relative like
    `clip`: TRL's absolute cap 5.0 is epsilon_high 4.0.
    """
    del epsilon_low, dual_clip_c
    ratio = safe_exp(log_ratio).detach()
    lower = None if cispo_epsilon_low is None else 1.0 - cispo_epsilon_low
    weight = ratio.clamp(min=lower, max=1.0 + epsilon_high)
    loss = -weight * adv * logprobs
    high = mask & (ratio > 1.0 + epsilon_high)
    low = mask & (ratio < lower) if lower is not None else torch.zeros_like(mask)
    return ObjectiveOutput(masked_values(loss, mask), low, high)


OBJECTIVES: dict[str, ObjectiveFn] = {
    "clip": clip_objective,
    "gspo": gspo_objective,
    "gspo_token": gspo_token_objective,
    "cispo": cispo_objective,
}
"""`objective.kind` registry."""


def policy_objective(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kind: str,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip_c: float | None,
    cispo_epsilon_low: float | None,
) -> ObjectiveOutput:
    """Per-token loss of objective `kind` (see OBJECTIVES).

    logprobs (b, T) with grad; old_logprobs (b, T) (pass logprobs.detach() on-policy); advantages (b,) or
    (b, T); mask (b, T) bool. Log-ratios are fp32; a non-finite log-ratio at a valid position raises.
    """
    log_ratio = masked_log_ratio(logprobs, old_logprobs.detach(), mask, name="logprobs - old_logprobs")
    adv = token_advantages(advantages, mask)
    return OBJECTIVES[kind](
        masked_values(logprobs, mask), log_ratio, adv, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        dual_clip_c=dual_clip_c, cispo_epsilon_low=cispo_epsilon_low,
    )
