"""Score a rollout: decode completions, call the reward functions, compute group advantages and stats."""

from __future__ import annotations

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.data.prompts import Prompt
from grpo_cli.rewards.resolve import RewardFn, score
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.loss import compute_advantages


def decode_completions(tokenizer, rollout: RolloutBatch) -> list[str]:
    return tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)


def reward_step(cfg: GRPOConfig, fns: list[RewardFn], prompts: list[Prompt], completions: list[str],
                rollout: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages (B,), rewards (B,), metrics) for completions of `prompts`, each repeated G times."""
    g = cfg.train.generations_per_prompt
    texts = [p.text for p in prompts for _ in range(g)]
    keys = prompts[0].columns.keys() if prompts else []
    columns = {k: [p.columns.get(k) for p in prompts for _ in range(g)] for k in keys}
    table, errors = score(fns, texts, completions, columns, on_error=cfg.rewards.on_error)
    per_func = torch.tensor(table, dtype=torch.float32)
    advantages, rewards = compute_advantages(
        per_func, weights=[f.weight for f in fns], group_size=g, algorithm=cfg.algorithm
    )
    grouped = rewards.view(-1, g)
    valid = rewards[~rewards.isnan()]
    lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float32)
    metrics = {
        "reward/mean": float(valid.mean()) if len(valid) else float("nan"),
        "reward/std": float(valid.std()) if len(valid) > 1 else 0.0,
        "reward/frac_zero_std_groups": float((grouped.nan_to_num().std(dim=1) == 0).float().mean()),
        "rewards/errors": float(errors),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": sum(r == "length" for r in rollout.finish_reasons) / len(lengths),
    }
    for fn, col in zip(fns, per_func.T, strict=True):
        ok = col[~col.isnan()]
        metrics[f"reward/{fn.label}/mean"] = float(ok.mean()) if len(ok) else float("nan")
    return advantages, rewards, metrics
