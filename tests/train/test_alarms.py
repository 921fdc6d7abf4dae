"""Run alarms: truncation is an alarm only once it lasts; the others judge one step."""

from __future__ import annotations

from grpo_cli.train.supervise.alarms import TRUNCATION_STEPS, StepAlarms, step_alarms


def test_truncation_alarms_once_it_lasts_and_once_per_streak():
    alarms = StepAlarms()
    truncated, fine = {"completions/clipped_ratio": 0.9}, {"completions/clipped_ratio": 0.1}
    said = [alarms.check(m) for m in [truncated, fine] + [truncated] * (TRUNCATION_STEPS + 2)]
    hits = [i for i, out in enumerate(said) if any("max_completion_length" in a for a in out)]
    assert hits == [1 + TRUNCATION_STEPS]  # a one-step blip (a policy still learning to stop) says nothing
    assert f"for {TRUNCATION_STEPS} steps in a row" in said[hits[0]][0]


def test_single_step_alarms_still_fire_at_once():
    assert any("no learning signal" in a for a in StepAlarms().check({"reward/frac_zero_std_groups": 1.0}))
    assert any("k3_kl" in a for a in step_alarms({"rollout_correction/k3_kl": 0.5}))
