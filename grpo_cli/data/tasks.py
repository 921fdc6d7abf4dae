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


SHAPE_COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220)}
SHAPE_KINDS = ("circle", "square", "triangle")
SHAPE_QUESTIONS = {"colour": "what colour are the shapes ?", "count": "how many shapes are there ?"}
SHAPE_SIZE = 56
"""The shapes images are SHAPE_SIZE² pixels: 4 × 4 patches of 14, 4 image tokens for the tiny VLM."""


def draw_shapes(colour: str, count: int, kind: str, rng: random.Random):
    """A SHAPE_SIZE² RGB image, white, with `count` shapes of `kind` in `colour`, each in its own cell of a 2 × 2
    grid (cells and offsets drawn from `rng`)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SHAPE_SIZE, SHAPE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    cell = SHAPE_SIZE // 2
    for c in rng.sample(range(4), count):
        x0, y0 = (c % 2) * cell + rng.randint(1, 4), (c // 2) * cell + rng.randint(1, 4)
        x1, y1 = x0 + cell - 6, y0 + cell - 6
        fill = SHAPE_COLOURS[colour]
        if kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
    return image


def shapes_task(n: int = 256, seed: int = 0, split: str = "train") -> list[dict]:
    """One image per prompt (PIL-drawn: 1–3 shapes of one kind and colour) and a question about it: "what colour
    are the shapes ?" (answer `red`/`green`/`blue`) or "how many shapes are there ?" (`one`/`two`/`three`), for
    exact-match rewards; a vision-language model's task (`builtin:tiny-vlm`)."""
    rng = random.Random(seed)
    combos = split_combos(list(product(SHAPE_QUESTIONS, SHAPE_COLOURS, range(1, 4), SHAPE_KINDS)), split)
    rows = []
    for question, colour, count, kind in (rng.choice(combos) for _ in range(n)):
        image = draw_shapes(colour, count, kind, rng)
        rows.append({
            "prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                    {"type": "text", "text": SHAPE_QUESTIONS[question]}]}],
            "answer": colour if question == "colour" else NUMBER_WORDS[count],
        })
    return rows


BUILTIN_TASKS = {"words": words_task, "arith": arith_task, "shapes": shapes_task}
