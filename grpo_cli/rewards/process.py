"""Process (step) rewards: split completions into steps, call step reward functions, and find the token at which
each step ends, so that `algo.advantages.process_advantages` can credit each step's reward to the tokens before it."""

from __future__ import annotations

import math

from grpo_cli.rewards.resolve import RewardError, RewardFn


def split_steps(text: str, separator: str) -> tuple[list[str], list[int]]:
    """Non-blank pieces of `text` between separators, and the character offset where each ends (the separator
    that closes it included, so a step's reward lands on its last token)."""
    steps, ends, start = [], [], 0
    for piece in text.split(separator):
        stop = min(len(text), start + len(piece) + len(separator))
        if piece.strip():
            steps.append(piece)
            ends.append(stop)
        start += len(piece) + len(separator)
    return steps, ends


def step_end_tokens(decode, ids: list[int], char_ends: list[int]) -> list[int]:
    """Index of the first token whose decoded prefix reaches each character offset (binary search on
    `len(decode(ids[:t+1]))`, which grows with t); clamped to the last token."""
    out = []
    for end in char_ends:
        lo, hi = 0, max(0, len(ids) - 1)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(ids[: mid + 1])) >= end:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    return out


def score_steps(rf: RewardFn, prompts: list[str], completions: list[str], steps: list[list[str]],
                columns: dict[str, list]) -> list[list[float]]:
    """Call a process reward `f(prompts, completions, *, steps, **columns)`: one list of floats (or None) per
    completion, one value per step. None becomes NaN (the step is left out)."""
    try:
        values = rf.fn(prompts, completions, steps=steps, **columns, **rf.kwargs)
    except Exception as exc:  # noqa: BLE001 - user code: report which function and sample
        raise RewardError(f"process reward '{rf.name}' raised {type(exc).__name__}: {exc} (first completion: "
                          f"{completions[0]!r}, its steps: {steps[0]!r}).") from exc
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        raise RewardError(f"process reward '{rf.name}' must return one list per completion ({len(completions)}), "
                          f"got {type(values).__name__}.")
    out = []
    for i, (row, want) in enumerate(zip(values, steps, strict=True)):
        if not isinstance(row, (list, tuple)) or len(row) != len(want):
            raise RewardError(f"process reward '{rf.name}' returned {row!r} for completion {i} ({completions[i]!r}),"
                              f" which has {len(want)} steps: it must return one float (or None) per step.")
        bad = [v for v in row if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v))]
        if bad:
            raise RewardError(f"process reward '{rf.name}' returned {bad[0]!r} for completion {i}; step rewards "
                              "must be finite numbers or None.")
        out.append([math.nan if v is None else float(v) for v in row])
    return out
