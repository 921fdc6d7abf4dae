"""Reward functions for tool-calling rollouts (name them as `grpo_cli.agent.rewards:tool_call`)."""

from __future__ import annotations

from grpo_cli.agent.tools import parse_hermes


def _opening(text: str, tool: str) -> float:
    """Share of a hermes call's opening words (`<tool_call> {"name": "TOOL", "arguments":`) that `text` writes in
    order from its first `<tool_call>` (whitespace-split, as the model's words)."""
    want = ["<tool_call>", '{"name":', f'"{tool}",' if tool else None, '"arguments":']
    want = [w for w in want if w]
    words = text[text.find("<tool_call>"):].split()
    matched = 0
    for have, need in zip(words, want):
        if have != need:
            break
        matched += 1
    return matched / len(want)


def tool_call(prompts, completions, *, messages: list | None = None, tool: str = "", **_columns) -> list[float]:
    """Shaping for learning to call a tool: 1.0 when the completion holds a well-formed hermes call (to `tool`, if
    given) that ran without error (its result in `messages`), 0.6 when well-formed but it failed, and while there
    is none, 0.5 × the share of the call's opening words written in order after a `<tool_call>` tag (0 without
    one)."""
    out = []
    for j, c in enumerate(completions):
        calls = [k for k in parse_hermes(c) if k.arguments is not None and (not tool or k.name == tool)]
        results = [m["content"] for m in (messages[j] if messages else []) if m["role"] == "tool"]
        ran = any(not r.startswith("error:") for r in results)
        out.append(1.0 if calls and ran else 0.6 if calls else 0.5 * _opening(c, tool) if "<tool_call>" in c
                   else 0.0)
    return out


def environment(prompts, completions, *, environment_rewards: list | None = None, **_columns) -> list[float | None]:
    """Each rollout's `agent.environment` instance's `reward()` (None, left out of the mean, where it has none)."""
    if environment_rewards is None:
        raise ValueError("the environment reward needs agent.environment (a class with a reward() method)")
    return list(environment_rewards)
