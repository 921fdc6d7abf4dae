"""Group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300): outcome and process supervision.

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


def _normalise(values: Tensor, group: Tensor, num_groups: int, *, scale_rewards: str, epsilon: float) -> Tensor:
    """(x - mean_group) / (scale + ε) over non-NaN entries; NaN entries -> 0. `none`: no division, no ε."""
    values = values.float()
    valid = ~torch.isnan(values)
    if bool(torch.isinf(values).any()):
        raise ValueError("rewards: ±inf reward(s); reward functions must return finite floats or None.")
    clean = torch.where(valid, values, torch.zeros_like(values))
    centered = clean - _group_mean(clean, group, valid, num_groups)
    denominator = REWARD_SCALES[scale_rewards](clean, group, valid, num_groups, epsilon)
    return torch.where(valid, centered / denominator, torch.zeros_like(centered))


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


def group_advantages(rewards: Tensor, group_size: int, *, scale_rewards: str, epsilon: float) -> Tensor:
    """Outcome advantages A_i = (R_i − mean_group(R)) / (std_group(R) + ε) (GRPO, arXiv:2402.03300 §4.1.2).

    rewards: (B,) with B = P·G and the G rows of a group contiguous (row i belongs to group i // group_size);
    NaN rewards are left out of the mean and std and get A = 0. std is Bessel-corrected; a group with one
    valid reward (or identical rewards) gets A = 0. scale_rewards: `group` | `batch` (std over all valid
    rewards, mean still per group) | `none` (A = R − mean; Dr. GRPO, arXiv:2503.20783). Returns fp32 (B,).
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}")
    num_groups = rewards.shape[0] // group_size
    group = torch.arange(rewards.shape[0], device=rewards.device) // group_size
    return _normalise(rewards, group, num_groups, scale_rewards=scale_rewards, epsilon=epsilon)


def process_advantages(
    step_rewards: Tensor, step_ends: Tensor, group_size: int, num_tokens: int, *, scale_rewards: str, epsilon: float
) -> Tensor:
    """Process-supervision advantages (GRPO, arXiv:2402.03300 §4.1.3).

    step_rewards: (B, S) reward of each reasoning step, NaN for padding (sequences have different step counts);
    step_ends: (B, S) integer index of the last completion token of each step (ignored where the reward is NaN).
    All valid step rewards of a group are normalised together, r̃ = (r − mean_group) / (std_group + ε)
    (Bessel; `scale_rewards` as in `group_advantages`), and token t gets A_t = Σ_{steps s with end_s ≥ t} r̃_s.
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
    norm = _normalise(step_rewards.reshape(-1), group, b // group_size, scale_rewards=scale_rewards, epsilon=epsilon)
    at_end = torch.zeros(b, num_tokens, dtype=torch.float32, device=step_rewards.device)
    at_end.scatter_add_(1, ends, norm.reshape(b, s))
    # A_t = Σ_{t' ≥ t} at_end[t']: a reverse cumulative sum.
    return at_end.flip(-1).cumsum(-1).flip(-1)
