"""Tools for the example: typed functions whose docstrings become the schema the model is shown."""

from __future__ import annotations


def calculator(a: int, b: int) -> int:
    """Add two whole numbers.

    a: the first number
    b: the second number
    """
    return a + b


def lookup(word: str) -> str:
    """The number a word names ("three" → 3), or an error the model reads.

    word: a number word from zero to ten
    """
    words = "zero one two three four five six seven eight nine ten".split()
    if word not in words:
        raise ValueError(f"{word!r} is not a number word")
    return str(words.index(word))
