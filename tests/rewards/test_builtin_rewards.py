"""Built-in rewards on hand-written cases."""

from __future__ import annotations

import pytest

from grpo_cli.rewards.builtin import exact_match, format_reward, length, math, overlong
from grpo_cli.rewards.resolve import RewardFn, score


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


def test_overlong_dapo_soft_penalty():
    # L_max 10, buffer 4: free up to 6 tokens, then (6 - L) / 4 down to -1 at 10.
    ids = [[1] * n for n in (0, 6, 7, 8, 10)]
    assert overlong(None, [""] * 5, completion_ids=ids, max_completion_length=10, buffer=4) == [
        0.0, 0.0, -0.25, -0.5, -1.0]
    with pytest.raises(ValueError, match="buffer"):
        overlong(None, [""], completion_ids=[[1]], max_completion_length=10, buffer=11)


def test_score_passes_rollout_facts_only_to_functions_that_name_them():
    def plain(prompts, completions, **columns):
        assert "completion_ids" not in columns
        return [0.0] * len(completions)

    def token_count(prompts, completions, *, completion_ids, **columns):
        return [float(len(i)) for i in completion_ids]

    fns = [RewardFn("plain", plain, 1.0, {}), RewardFn("count", token_count, 1.0, {}),
           RewardFn("overlong", overlong, 1.0, {"buffer": 2})]
    table, _ = score(fns, ["p", "p"], ["a", "b"], {}, on_error="raise",
                     extras={"completion_ids": [[1, 2, 3], [1]], "max_completion_length": 3})
    assert table == [[0.0, 3.0, -1.0], [0.0, 1.0, 0.0]]
