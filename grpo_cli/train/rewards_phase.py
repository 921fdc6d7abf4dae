"""Score a rollout: decode completions, call the reward functions, compute group advantages (outcome, or per
token with process rewards) and stats."""

from __future__ import annotations

import torch

from grpo_cli.algo.advantages import weighted_rewards
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.data.prompts import Prompt
from grpo_cli.rewards.resolve import RewardFn, score
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.loss import compute_advantages
from grpo_cli.train.step_rewards import StepRewards


def decode_completions(tokenizer, rollout: RolloutBatch) -> list[str]:
    return tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)


def reward_step(cfg: GRPOConfig, fns: list[RewardFn], prompts: list[Prompt], completions: list[str],
                rollout: RolloutBatch, tokenizer=None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages, rewards (B,), metrics) for completions of `prompts`, each repeated G times. Advantages are
    (B,) with outcome rewards only, (B, T) when a process reward function is configured (needs `tokenizer`)."""
    g = cfg.train.generations_per_prompt
    texts = [p.text for p in prompts for _ in range(g)]
    keys = prompts[0].columns.keys() if prompts else []
    columns = {k: [p.columns.get(k) for p in prompts for _ in range(g)] for k in keys}
    outcome = [f for f in fns if f.kind == "outcome"]
    table, errors = score(outcome, texts, completions, columns, on_error=cfg.rewards.on_error)
    per_func = torch.tensor(table, dtype=torch.float32).reshape(len(completions), len(outcome))
    if len(outcome) == len(fns):
        advantages, rewards = compute_advantages(
            per_func, weights=[f.weight for f in fns], group_size=g, algorithm=cfg.algorithm
        )
    else:
        steps = StepRewards.score(cfg, fns, texts, completions, columns, rollout, tokenizer)
        per_func = steps.merge(fns, outcome, per_func)
        rewards = weighted_rewards(per_func, [f.weight for f in fns])
        advantages = steps.advantages(cfg, fns, per_func, num_tokens=max(1, *map(len, rollout.completion_ids)))
    metrics = _reward_metrics(rewards, g, rollout, errors)
    for fn, col in zip(fns, per_func.T, strict=True):
        ok = col[~col.isnan()]
        metrics[f"reward/{fn.label}/mean"] = float(ok.mean()) if len(ok) else float("nan")
    return advantages, rewards, metrics


def _reward_metrics(rewards: torch.Tensor, g: int, rollout: RolloutBatch, errors: int) -> dict[str, float]:
    grouped = rewards.view(-1, g)
    valid = rewards[~rewards.isnan()]
    lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float32)
    return {
        "reward/mean": float(valid.mean()) if len(valid) else float("nan"),
        "reward/std": float(valid.std()) if len(valid) > 1 else 0.0,
        "reward/frac_zero_std_groups": float((grouped.nan_to_num().std(dim=1) == 0).float().mean()),
        "rewards/errors": float(errors),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": sum(r == "length" for r in rollout.finish_reasons) / len(lengths),
    }
