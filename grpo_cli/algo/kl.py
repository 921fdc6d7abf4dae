"""KL-to-reference estimators k1, k2, k3 (Schulman, "Approximating KL divergence", 2020) and the β-penalty."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from grpo_cli.algo.numerics import expm1_minus_identity, masked_log_ratio, masked_values

# x = ref_logprobs − logprobs (fp32, 0 where masked) -> per-token estimate of KL(π_θ ‖ π_ref).
KLEstimatorFn = Callable[[Tensor], Tensor]


def k1(x: Tensor) -> Tensor:
    """k1 = logp − ref = −x (unbiased, high variance, can be negative)."""
    return -x


def k2(x: Tensor) -> Tensor:
    """k2 = ½ x² (biased, low variance, ≥ 0)."""
    return 0.5 * x * x


def k3(x: Tensor) -> Tensor:
    """k3 = expm1(x̂) − x̂ with x̂ = min(x, 20) (= e^x̂ − x̂ − 1; unbiased, ≥ 0; GRPO's choice, arXiv:2402.03300).

    The clamp applies to x itself, so past it the gradient is 0 (verl, ms-swift), not +1, which would push the
    policy away from the reference; expm1 keeps fp32 precision at small x (k3(1e-4) = 5.0002e-9, not 0).
    """
    return expm1_minus_identity(x)


KL_ESTIMATORS: dict[str, KLEstimatorFn] = {"k1": k1, "k2": k2, "k3": k3}
"""`kl.estimator` registry."""


class KLTerm(NamedTuple):
    """penalty = β·kl per token (added to the per-token loss, not IS-weighted); kl = the estimate. (b, T) fp32."""

    penalty: Tensor
    kl: Tensor


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *, beta: float, estimator: str) -> KLTerm:
    """Per-token β·k(x), x = ref_logprobs − logprobs (fp32), 0 at masked positions.

    logprobs (b, T) with grad, ref_logprobs (b, T) (detached here), mask (b, T) bool. Non-finite x at a valid
    position raises ValueError. No output clamp (verl/NeMo clamp to ±10; we keep the exact estimate).
    """
    x = masked_log_ratio(ref_logprobs.detach(), logprobs, mask, name="ref_logprobs - logprobs")
    kl = masked_values(KL_ESTIMATORS[estimator](x), mask)
    return KLTerm(penalty=beta * kl, kl=kl)
