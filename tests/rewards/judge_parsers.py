"""A `pkg:function` parser for the judge tests: "good" is 1, "bad" is 0, anything else has no score."""


def verdict(text: str) -> float | None:
    return {"good": 1.0, "bad": 0.0}.get(text.strip())


def any_answer(text: str) -> float:
    """Every answer scores 0.5 (a tiny checkpoint's babble included), so every answer is cached."""
    return 0.5
