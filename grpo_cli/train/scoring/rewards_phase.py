"""Score a rollout: decode completions, call the reward functions, compute group advantages (outcome, or per
token with process rewards) and stats."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_cli.algo.advantages import informative_groups, weighted_rewards
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.data.prompts import Prompt
from grpo_cli.rewards.resolve import RewardFn, pop_reward_metrics, score
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.loss import compute_advantages
from grpo_cli.train.scoring.step_rewards import StepRewards


@dataclass
class ScoredRollout:
    """P prompts, their P·G completions (group-contiguous) and each reward function's scores (B, F), NaN = None."""

    prompts: list[Prompt]
    rollout: RolloutBatch
    completions: list[str]
    per_func: torch.Tensor
    errors: int = 0
    """Reward-function calls that raised and were skipped (`rewards.on_error: skip`)."""
    steps: StepRewards | None = None
    """Step rewards and step ends when a process reward function is configured (`per_func` then holds each
    process function's mean step reward)."""


def decode_completions(tokenizer, rollout: RolloutBatch) -> list[str]:
    """The completions' text; of a multi-turn rollout, what the model wrote (its sampled tokens, every turn), not
    the tool results between them (reward functions get those as `messages`)."""
    ids = rollout.completion_ids
    if rollout.loss_masks is not None:
        ids = [[t for t, m in zip(row, mask, strict=True) if m] for row, mask in zip(ids, rollout.loss_masks,
                                                                                     strict=True)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def score_rollout(cfg: GRPOConfig, fns: list[RewardFn], tokenizer, prompts: list[Prompt], rollout: RolloutBatch,
                  *, group_size: int | None = None, max_completion_length: int | None = None) -> ScoredRollout:
    """Decode the completions of `prompts` (each repeated G times; G = `group_size`, default the training group
    size) and score them with every reward function. Functions that name `completion_ids`,
    `max_completion_length` (default `rollout.max_completion_length`) or `messages` (a multi-turn rollout's
    trajectories, else None) as parameters receive them."""
    g = group_size or cfg.train.generations_per_prompt
    completions = decode_completions(tokenizer, rollout)
    texts = [p.text for p in prompts for _ in range(g)]
    keys = prompts[0].columns.keys() if prompts else []
    columns = {k: [p.columns.get(k) for p in prompts for _ in range(g)] for k in keys}
    extras = {"completion_ids": rollout.completion_ids,
              "max_completion_length": max_completion_length or cfg.rollout.max_completion_length,
              "messages": rollout.trajectories, "environment_rewards": rollout.environment_rewards,
              "prompt_messages": [p.messages for p in prompts for _ in range(g)]}
    outcome = [f for f in fns if f.kind == "outcome"]
    table, errors = score(outcome, texts, completions, columns, on_error=cfg.rewards.on_error, extras=extras)
    per_func = torch.tensor(table, dtype=torch.float32).reshape(len(completions), len(outcome))
    steps = None
    if len(outcome) < len(fns):
        steps = StepRewards.score(cfg, fns, texts, completions, columns, rollout, tokenizer)
        per_func = steps.merge(fns, outcome, per_func)
    return ScoredRollout(prompts, rollout, completions, per_func, errors, steps)


def reward_metrics(cfg: GRPOConfig, fns: list[RewardFn], scored: ScoredRollout) -> dict[str, float]:
    """Reward, length and truncation statistics of the scored completions."""
    g = cfg.train.generations_per_prompt
    rewards = weighted_rewards(scored.per_func, [f.weight for f in fns])
    valid = rewards[~rewards.isnan()]
    masks = getattr(scored.rollout, "loss_masks", None)  # multi-turn: sampled tokens only
    lengths = torch.tensor([sum(m) for m in masks] if masks is not None else
                           [len(c) for c in scored.rollout.completion_ids], dtype=torch.float32)
    metrics = {
        "reward/mean": float(valid.mean()) if len(valid) else float("nan"),
        "reward/std": float(valid.std()) if len(valid) > 1 else 0.0,
        "reward/frac_zero_std_groups": 1.0 - float(informative_groups(rewards, g).float().mean()),
        "rewards/errors": float(scored.errors),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": sum(r == "length" for r in scored.rollout.finish_reasons) / len(lengths),
    }
    for fn, col in zip(fns, scored.per_func.T, strict=True):
        ok = col[~col.isnan()]
        metrics[fn.metric] = float(ok.mean()) if len(ok) else float("nan")
    metrics.update(pop_reward_metrics(fns))  # a judge's counts over every round of the step
    return metrics


def reward_step(cfg: GRPOConfig, fns: list[RewardFn], scored: ScoredRollout,
                generated: ScoredRollout | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages, rewards (B,), metrics) of the completions the step trains on (`scored`); the reward
    metrics describe everything generated for the step (`generated`, default `scored`). Advantages are (B,), or
    (B, T) with process rewards."""
    weights = [f.weight for f in fns]
    if scored.steps is None:
        advantages, rewards = compute_advantages(
            scored.per_func, weights=weights, group_size=cfg.train.generations_per_prompt, algorithm=cfg.algorithm,
        )
    else:
        rewards = weighted_rewards(scored.per_func, weights)
        advantages = scored.steps.advantages(cfg, fns, scored.per_func,
                                             num_tokens=max(1, *map(len, scored.rollout.completion_ids)))
    return advantages, rewards, reward_metrics(cfg, fns, scored if generated is None else generated)
