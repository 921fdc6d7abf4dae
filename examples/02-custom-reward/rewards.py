"""Custom rewards for examples/02-custom-reward. Signature: f(prompts, completions, **columns) -> list[float | None];
every dataset column (here `topic` and `max_words`) arrives as a keyword list, one value per completion."""

from __future__ import annotations


def mentions_topic(prompts, completions, *, topic, **_columns):
    """1.0 when the completion names the row's topic, else 0.0."""
    return [float(t in c.split()) for c, t in zip(completions, topic, strict=True)]


def within_budget(prompts, completions, *, max_words, **_columns):
    """0 within the row's word budget, −1 per word over it; None (left out) for rows without a budget."""
    return [None if m is None else -max(0, len(c.split()) - m) for c, m in zip(completions, max_words, strict=True)]


def topic_per_step(prompts, completions, *, steps, topic, **_columns):
    """Process (step) reward: for each step of a completion (its text split on `rewards.step_separator`), 1.0 when
    the step names the row's topic, else 0.0. Return one list per completion, one value (or None) per step."""
    return [[float(t in s.split()) for s in row] for row, t in zip(steps, topic, strict=True)]
