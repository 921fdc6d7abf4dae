"""DAPO dynamic sampling (arXiv:2503.14476 §3.2): train only on groups whose rewards differ, drawing more prompts
until the step has `prompts_per_step` of them (at most `max_extra_rounds` extra generation rounds).

Groups of identical rewards have advantage 0 and give no gradient; they only dilute the token-mean. Every rank
fills its own share; all ranks run the same number of rounds (they must take the same prompts from the cursor).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_cli.algo.advantages import informative_groups, weighted_rewards
from grpo_cli.runtime.dist import DistInfo, all_reduce_sum
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.scoring.rewards_phase import ScoredRollout
from grpo_cli.train.scoring.step_rewards import StepRewards

def _rows(scored: ScoredRollout, groups: list[int], g: int) -> ScoredRollout:
    """The given groups of `scored`, in that order."""
    rows = [j for k in groups for j in range(k * g, (k + 1) * g)]
    r = scored.rollout
    return ScoredRollout(
        prompts=[scored.prompts[k] for k in groups],
        rollout=RolloutBatch(
            prompt_ids=[r.prompt_ids[k] for k in groups],
            completion_ids=[r.completion_ids[j] for j in rows],
            finish_reasons=[r.finish_reasons[j] for j in rows],
            sampler_logprobs=None if r.sampler_logprobs is None else [r.sampler_logprobs[j] for j in rows],
            weight_version=r.weight_version,
            timings=r.timings,
            loss_masks=None if r.loss_masks is None else [r.loss_masks[j] for j in rows],
            trajectories=None if r.trajectories is None else [r.trajectories[j] for j in rows],
            environment_rewards=None if r.environment_rewards is None else [r.environment_rewards[j] for j in rows],
            metrics=r.metrics,
        ),
        completions=[scored.completions[j] for j in rows],
        per_func=scored.per_func[rows],
        errors=scored.errors,
        steps=None if scored.steps is None else scored.steps.rows(rows),
    )


def concat(parts: list[ScoredRollout]) -> ScoredRollout:
    """One ScoredRollout of several rounds, in order. Its weight version is the oldest (staleness is logged for the
    stalest rows; IS correction works per token from the sampler logprobs either way)."""
    rollouts = [p.rollout for p in parts]
    logprobs = None if any(r.sampler_logprobs is None for r in rollouts) else [
        row for r in rollouts for row in r.sampler_logprobs
    ]
    timings: dict[str, float] = {}
    for r in rollouts:
        for name, value in r.timings.items():
            timings[name] = timings.get(name, 0.0) + value
    return ScoredRollout(
        prompts=[p for part in parts for p in part.prompts],
        rollout=RolloutBatch(
            prompt_ids=[row for r in rollouts for row in r.prompt_ids],
            completion_ids=[row for r in rollouts for row in r.completion_ids],
            finish_reasons=[x for r in rollouts for x in r.finish_reasons],
            sampler_logprobs=logprobs,
            weight_version=min(r.weight_version for r in rollouts),
            timings=timings,
            loss_masks=None if any(r.loss_masks is None for r in rollouts) else [
                row for r in rollouts for row in r.loss_masks],
            trajectories=None if any(r.trajectories is None for r in rollouts) else [
                row for r in rollouts for row in r.trajectories],
            environment_rewards=None if any(r.environment_rewards is None for r in rollouts) else [
                x for r in rollouts for x in r.environment_rewards],
            metrics=rollouts[0].metrics,  # the step's first round
        ),
        completions=[c for part in parts for c in part.completions],
        per_func=torch.cat([p.per_func for p in parts]),
        errors=sum(p.errors for p in parts),
        steps=None if parts[0].steps is None else StepRewards.cat([p.steps for p in parts]),
    )


def fill_step(first: ScoredRollout, draw: Callable[[int], ScoredRollout], *, weights: list[float],
              group_size: int, max_extra_rounds: int, dist: DistInfo) -> tuple[ScoredRollout, ScoredRollout,
                                                                                 dict[str, float]]:
    """(batch to train on, everything generated, metrics) from the first round and `draw(r)`, which generates
    round r (r = 1, 2, ...) from new prompts.

    The batch has as many groups as `first`: the informative groups in generation order (the surplus of the last
    round is discarded), then, if `max_extra_rounds` ran out, dropped groups to fill it (`short_groups`).
    Metrics are totals over ranks: dropped_groups (identical rewards, left out), extra_rounds, drawn_prompts
    (prompts drawn by the extra rounds), short_groups.
    """
    want = len(first.prompts)
    rounds = [first]
    keep: list[int] = []
    flat: list[int] = []
    while True:
        offset = sum(len(r.prompts) for r in rounds[:-1])
        rewards = weighted_rewards(rounds[-1].per_func, weights)
        for k, informative in enumerate(informative_groups(rewards, group_size).tolist()):
            (keep if informative else flat).append(offset + k)
        missing = max(want - len(keep), 0)
        if len(rounds) > max_extra_rounds or all_reduce_sum(float(missing), dist) == 0:
            break
        rounds.append(draw(len(rounds)))
    generated = concat(rounds)
    short = max(want - len(keep), 0)
    batch = _rows(generated, keep[:want] + flat[:short], group_size)
    metrics = {
        "dynamic_sampling/dropped_groups": float(len(flat) - short),
        "dynamic_sampling/extra_rounds": float(len(rounds) - 1),
        "dynamic_sampling/drawn_prompts": float(sum(len(r.prompts) for r in rounds[1:])),
        "dynamic_sampling/short_groups": float(short),
    }
    # Totals over ranks (the loop then averages identical values); extra_rounds is the same on every rank.
    for name in ("dynamic_sampling/dropped_groups", "dynamic_sampling/drawn_prompts", "dynamic_sampling/short_groups"):
        metrics[name] = all_reduce_sum(metrics[name], dist)
    return batch, generated, metrics
