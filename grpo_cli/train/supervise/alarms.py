"""Alarms on a step's metrics: conditions under which a run looks fine but is not learning or is wrong."""

from __future__ import annotations

K3_KL_ALARM = 1e-2
TRUNCATION_STEPS = 3
"""Steps in a row with most completions truncated before that alarm: a policy that has not yet learned to stop (the
built-in default starts from random weights) runs past the cap for a step or two; a cap that is too low stays."""


class StepAlarms:
    """The alarms of a run, step after step (`check`): those of `step_alarms`, plus truncation once it lasted
    `TRUNCATION_STEPS` steps in a row (said once per streak)."""

    def __init__(self) -> None:
        self.truncated_streak = 0

    def check(self, metrics: dict[str, float]) -> list[str]:
        truncated = metrics.get("completions/clipped_ratio", 0.0) > 0.8
        self.truncated_streak = self.truncated_streak + 1 if truncated else 0
        out = step_alarms(metrics)
        if self.truncated_streak == TRUNCATION_STEPS:
            out.append(f"most completions hit rollout.max_completion_length for {TRUNCATION_STEPS} steps in a row "
                       "(raise it, or check the EOS token)")
        return out


def step_alarms(metrics: dict[str, float]) -> list[str]:
    """Human-readable alarms (each with a likely cause) of one step's metrics alone."""
    out = []
    if metrics.get("reward/frac_zero_std_groups", 0.0) > 0.8:
        out.append("no learning signal: all rewards identical in most groups (task too easy/hard, or a broken "
                   "reward parser)")
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
