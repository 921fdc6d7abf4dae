"""A tool parser for the tool-calling example's test: every finished turn looks up "three", then "blue"."""

from __future__ import annotations


def every_turn_looks_up(text: str) -> list[tuple[str, dict]]:
    return [("lookup", {"word": "three"}), ("lookup", {"word": "blue"})]
