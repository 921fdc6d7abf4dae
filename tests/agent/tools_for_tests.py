"""Tools the agent tests name as `tests/agent/tools_for_tests.py:NAME` (typed, documented, some misbehaving)."""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Add two numbers.

    a: first
    b: second
    """
    return a + b


def boom(x: int) -> int:
    """Always fails."""
    raise RuntimeError("tool exploded")


def spin(x: int) -> int:
    """Never returns."""
    while True:
        x += 1


def shout(text: str) -> str:
    """A long answer."""
    return " ".join([text] * 200)


def always_add(text: str) -> list[tuple[str, dict]]:
    """A tool parser that reads every finished turn as a call of `add` (so a random-init model exercises turns)."""
    return [("add", {"a": 2, "b": 3})]
