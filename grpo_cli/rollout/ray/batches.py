"""Splitting a step's prompts over rollout actors and merging their batches back, in order (async mode)."""

from __future__ import annotations

from grpo_cli.rollout.base import RolloutBatch, RolloutError


def split_evenly(items: list, parts: int) -> list[list]:
    """Consecutive chunks whose sizes differ by at most one (empty chunks when items < parts)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


def merge_batches(parts: list[RolloutBatch]) -> RolloutBatch:
    """Concatenate actor batches in actor order (prompt order is kept: chunks were consecutive), with their
    multi-turn fields (`merge_metrics` for `tools/*`)."""
    versions = {p.weight_version for p in parts}
    if len(versions) != 1:
        raise RolloutError(f"rollout actors sampled one step with different weight versions {sorted(versions)}; "
                           "a weight push was lost. Restart the run from its last checkpoint.")

    def rows(name: str) -> list | None:
        return None if any(getattr(p, name) is None for p in parts) else [x for p in parts for x in getattr(p, name)]

    return RolloutBatch(
        prompt_ids=rows("prompt_ids"), completion_ids=rows("completion_ids"), finish_reasons=rows("finish_reasons"),
        sampler_logprobs=rows("sampler_logprobs"),
        weight_version=versions.pop(),
        timings={name: max(p.timings.get(name, 0.0) for p in parts)
                 for name in {"generate", *(k for p in parts for k in p.timings)}},
        loss_masks=rows("loss_masks"), trajectories=rows("trajectories"),
        environment_rewards=rows("environment_rewards"),
        metrics=merge_metrics([p.metrics for p in parts], [len(p.completion_ids) for p in parts]),
    )


def merge_metrics(metrics: list[dict[str, float]], rows: list[int]) -> dict[str, float]:
    """One batch's `tools/*` from its parts': counts (`tools/errors`, `tools/timeouts`) add up, per-rollout means
    (`tools/calls_per_rollout`, `tools/turns`) are averaged weighted by each part's rollouts."""
    total = sum(rows) or 1
    names = {k for m in metrics for k in m}
    return {k: sum(m.get(k, 0.0) for m in metrics) if k in ("tools/errors", "tools/timeouts")
            else sum(m.get(k, 0.0) * n for m, n in zip(metrics, rows, strict=True)) / total for k in names}
