"""Built-in rewards on hand-written cases."""

from __future__ import annotations

import pytest

from grpo_cli.rewards.builtin import exact_match, format_reward, length, math


def test_length_words_and_chars():
    assert length(None, ["a b c", "a", ""], target=2) == [-1, -1, -2]
    assert length(None, ["abcd"], target=2, unit="chars") == [-2]
    with pytest.raises(ValueError):
        length(None, ["a"], target=1, unit="tokens")


def test_format_full_match():
    assert format_reward(None, ["<a>x</a>", "x <a>x</a>"], pattern=r"<a>.*</a>") == [1.0, 0.0]


def test_exact_match_and_missing_answers():
    assert exact_match(None, [" five ", "six", "x"], answer=["five", "five", None]) == [1.0, 0.0, None]
    with pytest.raises(ValueError, match="needs a 'answer' column"):
        exact_match(None, ["x"])


def test_math_last_number_boxed_and_gsm8k():
    answers = ["#### 42", "#### 42", "3/4", "#### 1,000", "no number"]
    completions = ["so it is 41 then 42", r"\boxed{42} and 7", "0.75", "1000", "5"]
    assert math(None, completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, None]
