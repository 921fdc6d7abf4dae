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


def nap(seconds: float) -> str:
    """Sleep, then answer."""
    import time

    time.sleep(seconds)
    return "awake"


def shout(text: str) -> str:
    """A long answer."""
    return " ".join([text] * 200)


def always_add(text: str) -> list[tuple[str, dict]]:
    """A tool parser that reads every finished turn as a call of `add` (so a random-init model exercises turns)."""
    return [("add", {"a": 2, "b": 3})]


class Counter:
    """An environment: the row's `answer_number` is the target; `guess` counts the tries and says how close."""

    def reset(self, answer_number: int = 0, **_row) -> None:
        self.target, self.tries = answer_number, 0

    def guess(self, value: int) -> str:
        """Guess the number.

        value: the guess
        """
        self.tries += 1
        return "right" if value == self.target else "higher" if value < self.target else "lower"

    def reward(self) -> float:
        return float(self.tries)


def always_guess(text: str) -> list[tuple[str, dict]]:
    """A tool parser reading every finished turn as `guess(5)`."""
    return [("guess", {"value": 5})]


def sample_then_note(*, engine, prompt_ids, sampling, tokenizer) -> list[dict]:
    """A `rollout.custom` function: one engine turn, then two environment tokens (mask 0) appended to each."""
    out = engine.generate(prompt_ids, sampling)
    note = tokenizer.encode("yes no", add_special_tokens=False)
    return [{"ids": ids + note, "mask": [1] * len(ids) + [0] * len(note), "logprobs": lps + [0.0] * len(note),
             "finish_reason": reason}
            for ids, lps, reason in zip(out.completion_ids, out.sampler_logprobs, out.finish_reasons, strict=True)]
