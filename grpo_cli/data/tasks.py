"""Built-in prompt tasks that need no download (`builtin:NAME`)."""

from __future__ import annotations

import random

TOPICS = "cat dog sun moon story world number".split()
VERBS = "say write tell count".split()


def words_task(n: int = 256, seed: int = 0) -> list[dict]:
    """Short instructions over the tiny tokenizer's vocabulary, e.g. "please say words about the cat"."""
    rng = random.Random(seed)
    return [
        {"prompt": [{"role": "user", "content": f"please {rng.choice(VERBS)} words about the {rng.choice(TOPICS)}"}]}
        for _ in range(n)
    ]


NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()


def arith_task(n: int = 256, seed: int = 0) -> list[dict]:
    """Single-digit sums ("what is two plus three ?") with the answer as a word and a number."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 5), rng.randint(0, 5)
        rows.append({
            "prompt": [{"role": "user", "content": f"what is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} ?"}],
            "answer": NUMBER_WORDS[a + b],
            "answer_number": a + b,
        })
    return rows


BUILTIN_TASKS = {"words": words_task, "arith": arith_task}
