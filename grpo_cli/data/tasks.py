"""Built-in prompt tasks that need no download (`builtin:NAME`), each with a held-out split
(`builtin:NAME:heldout`): one combination in five never appears in the training split."""

from __future__ import annotations

import random
from itertools import product

TOPICS = "cat dog sun moon story world number".split()
VERBS = "say write tell count".split()
HELDOUT_EVERY = 5
"""Combination i of a task is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1."""
SPLITS = ("train", "heldout")


def split_combos(combos: list, split: str) -> list:
    """The task's combinations that belong to `split` (`train` or `heldout`)."""
    held = [i % HELDOUT_EVERY == HELDOUT_EVERY - 1 for i in range(len(combos))]
    return [c for c, h in zip(combos, held, strict=True) if h == (split == "heldout")]


def words_task(n: int = 256, seed: int = 0, split: str = "train") -> list[dict]:
    """Short instructions over the tiny tokenizer's vocabulary, e.g. "please say words about the cat"."""
    rng = random.Random(seed)
    combos = split_combos(list(product(VERBS, TOPICS)), split)
    return [{"prompt": [{"role": "user", "content": f"please {verb} words about the {topic}"}]}
            for verb, topic in (rng.choice(combos) for _ in range(n))]


NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()


def arith_task(n: int = 256, seed: int = 0, split: str = "train") -> list[dict]:
    """Single-digit sums ("what is two plus three ?") with the answer as a word and a number."""
    rng = random.Random(seed)
    combos = split_combos(list(product(range(6), range(6))), split)
    rows = []
    for a, b in (rng.choice(combos) for _ in range(n)):
        rows.append({
            "prompt": [{"role": "user", "content": f"what is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} ?"}],
            "answer": NUMBER_WORDS[a + b],
            "answer_number": a + b,
        })
    return rows


BUILTIN_TASKS = {"words": words_task, "arith": arith_task}
