"""A `pkg:function` parser for the judge tests: "good" is 1, "bad" is 0, anything else has no score."""


def verdict(text: str) -> float | None:
    return {"good": 1.0, "bad": 0.0}.get(text.strip())
