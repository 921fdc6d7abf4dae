"""The judge's rating, written as a number word (the tiny model's vocabulary has no digits): the first of
zero … ten in the answer, scaled to [0, 1]; None (a missing score) when there is none."""

WORDS = "zero one two three four five six seven eight nine ten".split()


def number_word(text: str) -> float | None:
    for word in text.split():
        if word in WORDS:
            return WORDS.index(word) / 10
    return None
