"""Group-relative advantages (GRPO, arXiv:2402.03300; RLOO; REINFORCE++ baseline): outcome and process supervision.

NaN rewards mean "missing" (a reward function returned None): excluded from statistics, advantage 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# (values, group_index, valid, num_groups, epsilon) -> per-element denominator of the centred reward.
ScaleFn = Callable[[Tensor, Tensor, Tensor, int, float], Tensor]


def _group_sums(values: Tensor, group: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, group, values)


def _group_mean(values: Tensor, group: Tensor, valid: Tensor, num_groups: int) -> Tensor:
    """Per-element mean of the valid elements of its group (0 for groups without valid elements)."""
    x = torch.where(valid, values, torch.zeros_like(values))
    count = _group_sums(valid.to(values.dtype), group, num_groups)
    mean = _group_sums(x, group, num_groups) / count.clamp(min=1.0)
    return mean[group]


def _group_std(values: Tensor, group: Tensor, valid: Tensor, num_groups: int) -> Tensor:
    """Bessel-corrected std of the valid elements of each group; 0 for groups with fewer than 2."""
    mean = _group_mean(values, group, valid, num_groups)
    sq = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values))
    count = _group_sums(valid.to(values.dtype), group, num_groups)
    var = _group_sums(sq, group, num_groups) / (count - 1.0).clamp(min=1.0)
    return torch.sqrt(var)[group]


def _scale_group(values: Tensor, group: Tensor, valid: Tensor, num_groups: int, epsilon: float) -> Tensor:
    """std of the element's group + ε."""
    return _group_std(values, group, valid, num_groups) + epsilon


def _scale_batch(values: Tensor, group: Tensor, valid: Tensor, num_groups: int, epsilon: float) -> Tensor:
    """Bessel-corrected std of every valid element of the batch + ε, broadcast."""
    del num_groups
    return _group_std(values, torch.zeros_like(group), valid, 1) + epsilon


def _scale_none(values: Tensor, group: Tensor, valid: Tensor, num_groups: int, epsilon: float) -> Tensor:
    """No division (and no ε): A = R − mean."""
    del group, valid, num_groups, epsilon
    return torch.ones_like(values)


REWARD_SCALES: dict[str, ScaleFn] = {"group": _scale_group, "batch": _scale_batch, "none": _scale_none}
"""`scale_rewards` registry: group (std per group), batch (std of all rewards; mean stays per group), none."""

# (values (N,) fp64, 0 where invalid; group; valid; num_groups, *, scale_rewards, epsilon) -> fp64 (N,) advantages.
EstimatorFn = Callable[..., Tensor]


def _grpo(values: Tensor, group: Tensor, valid: Tensor, num_groups: int, *, scale_rewards: str,
          epsilon: float) -> Tensor:
    """GRPO: A_i = (R_i − mean_group(R)) / scale_i, scale from REWARD_SCALES[scale_rewards] (std + ε, or 1)."""
    centered = values - _group_mean(values, group, valid, num_groups)
    return centered / REWARD_SCALES[scale_rewards](values, group, valid, num_groups, epsilon)


def _rloo(values: Tensor, group: Tensor, valid: Tensor, num_groups: int, *, scale_rewards: str,
          epsilon: float) -> Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = R_i − (Σ_{j≠i} R_j) / (n − 1) = n/(n−1)·(R_i − mean),
    n = valid rewards of the group; 0 when n = 1. No scaling: scale_rewards and epsilon do not apply."""
    del scale_rewards, epsilon
    count = _group_sums(valid.to(values.dtype), group, num_groups)[group]
    others = _group_sums(values, group, num_groups)[group] - values
    return torch.where(count > 1, values - others / (count - 1.0).clamp(min=1.0), torch.zeros_like(values))


def _reinforce_pp(values: Tensor, group: Tensor, valid: Tensor, num_groups: int, *, scale_rewards: str,
                  epsilon: float) -> Tensor:
    """REINFORCE++ baseline (Hu et al. 2025, arXiv:2501.03262): a_i = R_i − mean_group(R), then whitened over the
    batch's valid rewards: A_i = (a_i − mean(a)) / (std(a) + ε), std with Bessel's correction (mean(a) is 0 up
    to rounding). verl/OpenRLHF whiten over tokens (a long completion counts once per token); this is per
    sequence. scale_rewards does not apply."""
    del scale_rewards
    centered = torch.where(valid, values - _group_mean(values, group, valid, num_groups), torch.zeros_like(values))
    batch = torch.zeros_like(group)
    return (centered - _group_mean(centered, batch, valid, 1)) / (_group_std(centered, batch, valid, 1) + epsilon)


ADVANTAGE_ESTIMATORS: dict[str, EstimatorFn] = {"grpo": _grpo, "rloo": _rloo, "reinforce_pp": _reinforce_pp}
"""`advantage.estimator` registry: grpo (group mean / std), rloo (leave-one-out mean), reinforce_pp (group mean,
batch whitening)."""


def _flat_groups(values: Tensor, group: Tensor, valid: Tensor, num_groups: int) -> Tensor:
    """Per element: its group's valid values are all equal (max == min), or it has none."""
    inf = torch.full_like(values, float("inf"))
    top = torch.full((num_groups,), -float("inf"), dtype=values.dtype, device=values.device)
    low = torch.full((num_groups,), float("inf"), dtype=values.dtype, device=values.device)
    top = top.scatter_reduce(0, group, torch.where(valid, values, -inf), reduce="amax")
    low = low.scatter_reduce(0, group, torch.where(valid, values, inf), reduce="amin")
    return (top <= low)[group]


def _normalise(values: Tensor, group: Tensor, num_groups: int, *, estimator: str, scale_rewards: str,
               epsilon: float) -> Tensor:
    """Advantages of `estimator` over non-NaN entries; NaN entries and groups of identical rewards -> exactly 0.

    Statistics are float64: an fp32 mean of a non-dyadic reward is one ulp off, which made a group of 64 rewards
    of 1000.1 get |A| = 0.86 instead of 0.
    """
    values = values.double()
    valid = ~torch.isnan(values)
    if bool(torch.isinf(values).any()):
        raise ValueError("rewards: ±inf reward(s); reward functions must return finite floats or None.")
    clean = torch.where(valid, values, torch.zeros_like(values))
    adv = ADVANTAGE_ESTIMATORS[estimator](
        clean, group, valid, num_groups, scale_rewards=scale_rewards, epsilon=epsilon
    )
    keep = valid & ~_flat_groups(clean, group, valid, num_groups)
    return torch.where(keep, adv, torch.zeros_like(adv)).float()


def weighted_rewards(rewards_per_func: Tensor, weights: Sequence[float] | Tensor) -> Tensor:
    """R_i = Σ_f w_f · r_if over the functions that scored sample i (NaN = None = not scored).

    rewards_per_func: (B, F); weights: F floats. Returns fp32 (B,); NaN where no function scored the sample.
    """
    r = rewards_per_func.float()
    w = torch.as_tensor(weights, dtype=torch.float32, device=r.device)
    if r.dim() != 2 or w.shape != (r.shape[1],):
        raise ValueError(f"rewards_per_func {tuple(r.shape)} needs shape (B, {w.numel()}) to match the weights")
    scored = ~torch.isnan(r)
    total = torch.where(scored, r * w, torch.zeros_like(r)).sum(dim=1)
    return torch.where(scored.any(dim=1), total, torch.full_like(total, float("nan")))


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(P,) bool: group g has at least two valid (non-NaN) rewards and they are not all equal, exactly.

    The groups that give a gradient; DAPO's dynamic sampling (arXiv:2503.14476 §3.2) keeps only these.
    rewards: (B,) = (P·G,), the G rows of a group contiguous.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}")
    values = rewards.double()
    valid = ~torch.isnan(values)
    group = torch.arange(values.shape[0], device=values.device) // group_size
    clean = torch.where(valid, values, torch.zeros_like(values))
    flat = _flat_groups(clean, group, valid, values.shape[0] // group_size)
    return ~flat.view(-1, group_size)[:, 0]


def group_advantages(
    rewards: Tensor, group_size: int, *, estimator: str, scale_rewards: str, epsilon: float
) -> Tensor:
    """Outcome advantages; `grpo`: A_i = (R_i − mean_group(R)) / (std_group(R) + ε) (arXiv:2402.03300 §4.1.2).

    rewards: (B,) with B = P·G and the G rows of a group contiguous (row i belongs to group i // group_size);
    NaN rewards are left out of the statistics and get A = 0. std is Bessel-corrected; a group with one valid
    reward, or identical rewards, gets A = 0 exactly (statistics in float64). scale_rewards (grpo): `group` |
    `batch` (std over all valid rewards, mean still per group) | `none` (A = R − mean; Dr. GRPO,
    arXiv:2503.20783). estimator `rloo`: A_i = R_i − mean_{j≠i} R_j; `reinforce_pp`: A_i = R_i − mean_group(R)
    whitened over the batch (see ADVANTAGE_ESTIMATORS). Returns fp32 (B,).
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}")
    num_groups = rewards.shape[0] // group_size
    group = torch.arange(rewards.shape[0], device=rewards.device) // group_size
    return _normalise(rewards, group, num_groups, estimator=estimator, scale_rewards=scale_rewards, epsilon=epsilon)


def process_advantages(
    step_rewards: Tensor,
    step_ends: Tensor,
    group_size: int,
    num_tokens: int,
    *,
    estimator: str,
    scale_rewards: str,
    epsilon: float,
) -> Tensor:
    """Process-supervision advantages (GRPO, arXiv:2402.03300 §4.1.3).

    step_rewards: (B, S) reward of each reasoning step, NaN for padding (sequences have different step counts);
    step_ends: (B, S) integer index of the last completion token of each step (ignored where the reward is NaN).
    All valid step rewards of a group are normalised together, r̃ = (r − mean_group) / (std_group + ε)
    (Bessel; `estimator` and `scale_rewards` as in `group_advantages`, over the group's step rewards), and token
    t gets A_t = Σ_{steps s with end_s ≥ t} r̃_s.
    Tokens after the last step get 0. Returns fp32 (B, num_tokens).
    """
    if step_rewards.shape != step_ends.shape or step_rewards.dim() != 2:
        raise ValueError(f"step_rewards {tuple(step_rewards.shape)} and step_ends {tuple(step_ends.shape)} differ")
    b, s = step_rewards.shape
    if group_size < 1 or b % group_size:
        raise ValueError(f"{b} sequences cannot be split into groups of {group_size}")
    valid = ~torch.isnan(step_rewards)
    ends = torch.where(valid, step_ends.long(), torch.zeros_like(step_ends, dtype=torch.long))
    if bool(((ends < 0) | (ends >= num_tokens)).any()):
        raise ValueError(f"step_ends must lie in [0, {num_tokens}) for every step with a reward")
    group = (torch.arange(b, device=step_rewards.device) // group_size).repeat_interleave(s)
    norm = _normalise(step_rewards.reshape(-1), group, b // group_size, estimator=estimator,
                      scale_rewards=scale_rewards, epsilon=epsilon)
    at_end = torch.zeros(b, num_tokens, dtype=torch.float32, device=step_rewards.device)
    at_end.scatter_add_(1, ends, norm.reshape(b, s))
    # A_t = Σ_{t' ≥ t} at_end[t']: a reverse cumulative sum.
    return at_end.flip(-1).cumsum(-1).flip(-1)
