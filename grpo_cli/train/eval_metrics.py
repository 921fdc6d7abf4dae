"""Evaluation metrics of scored completions, summed on each rank and reduced over ranks: eval/reward/mean,
eval/reward/<fn>/mean, eval/pass@k (unbiased estimator) and eval/completions/mean_length: `eval/` + training's name."""

from __future__ import annotations

import torch

from grpo_cli.algo.advantages import weighted_rewards
from grpo_cli.algo.pass_at_k import k_values, pass_at_k
from grpo_cli.config.sections import EvalConfig
from grpo_cli.rewards.resolve import RewardFn
from grpo_cli.runtime.dist import DistInfo, all_reduce_sum


def _sum_count(values: torch.Tensor) -> tuple[float, float]:
    ok = values[~values.isnan()]
    return float(ok.sum()), float(len(ok))


def local_sums(cfg: EvalConfig, *, per_func: torch.Tensor, reward_fns: list[RewardFn],
               completion_ids: list[list[int]], group_size: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of every metric over this rank's completions (B = prompts × group_size, group-contiguous);
    a missing score (None → NaN) is left out of its mean and counts as not correct for pass@k. A function's metric
    is `eval/` + training's (`RewardFn.metric`: `reward/<alias or function name>/mean`, never a path)."""
    out: dict[str, tuple[float, float]] = {}
    rewards = weighted_rewards(per_func, [f.weight for f in reward_fns])
    if "reward" in cfg.metrics:
        out["eval/reward/mean"] = _sum_count(rewards)
    if "per_function" in cfg.metrics:
        for fn, col in zip(reward_fns, per_func.T, strict=True):
            out[f"eval/{fn.metric}"] = _sum_count(col)
    if "pass_at_k" in cfg.metrics:
        correct = (rewards >= cfg.pass_threshold).reshape(-1, group_size).sum(dim=1)
        for k in k_values(group_size):
            out[f"eval/pass@{k}"] = (float(pass_at_k(correct, n=group_size, k=k).sum()), float(len(correct)))
    if "length" in cfg.metrics:
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float64)
        out["eval/completions/mean_length"] = (float(lengths.sum()), float(len(lengths)))
    return out


def reduce_means(sums: dict[str, tuple[float, float]], dist: DistInfo) -> dict[str, float]:
    """Global means: every rank's sums and counts added (collective; same keys on every rank)."""
    out = {}
    for key in sorted(sums):
        total, count = (all_reduce_sum(v, dist) for v in sums[key])
        out[key] = total / count if count else float("nan")
    return out
