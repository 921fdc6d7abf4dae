"""Alarms on a step's metrics: conditions under which a run looks fine but is not learning or is wrong."""

from __future__ import annotations

K3_KL_ALARM = 1e-2


def step_alarms(metrics: dict[str, float]) -> list[str]:
    """Human-readable alarms (each with a likely cause) for one step's metrics."""
    out = []
    if metrics.get("reward/frac_zero_std_groups", 0.0) > 0.8:
        out.append("no learning signal: all rewards identical in most groups (task too easy/hard, or a broken "
                   "reward parser)")
    if metrics.get("completions/clipped_ratio", 0.0) > 0.8:
        out.append("most completions hit rollout.max_completion_length (raise it, or check the EOS token)")
    w = metrics.get("rollout_correction/is_weight_mean")
    if w is not None and (w < 0.5 or w > 2.0):
        out.append(f"IS weights collapsing (mean {w:.3g}): the engine may hold stale weights or a stale cache")
    k3 = metrics.get("rollout_correction/k3_kl")
    lag = metrics.get("staleness", 0.0)
    if k3 is not None and k3 > K3_KL_ALARM and lag > 0:
        out.append(f"policy lag ({lag:.0f} step) + engine mismatch k3_kl={k3:.3g} > {K3_KL_ALARM:g}: expected to "
                   "be larger in async mode and corrected by algorithm.is_correction / off_policy_sequence_mask_delta;"
                   " lower train.learning_rate or rollout.max_staleness if rewards stall")
    elif k3 is not None and k3 > K3_KL_ALARM:
        out.append(f"training–inference mismatch k3_kl={k3:.3g} > {K3_KL_ALARM:g}: enable or tighten "
                   "algorithm.is_correction (see `grpo diagnose-mismatch`)")
    return out
