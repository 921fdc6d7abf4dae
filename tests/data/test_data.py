"""Prompt sources, chat rendering, the overlong policy and the resumable cursor."""

from __future__ import annotations

import json

import pytest

from grpo_cli.data.prompts import PromptCursor, tokenize_prompts
from grpo_cli.data.sources import DataError, load_rows


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def test_jsonl_parquet_and_saved_dataset(tmp_path):
    rows = [{"prompt": "say one word", "answer": "one"}, {"prompt": "count to two", "answer": "two"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_rows(str(tmp_path / "p.jsonl")) == rows
    import datasets

    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    assert load_rows(str(tmp_path / "p.parquet")) == rows
    assert load_rows(str(tmp_path / "saved")) == rows


@pytest.mark.parametrize("source,match", [("builtin:nope", "unknown built-in task"),
                                          ("/no/such.jsonl", "does not exist"), ("x.csv", "does not exist")])
def test_bad_sources(source, match):
    with pytest.raises(DataError, match=match):
        load_rows(source)


def test_bad_jsonl_line_is_named(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(DataError, match=r"b\.jsonl:2 is not valid JSON"):
        load_rows(str(tmp_path / "b.jsonl"))


def test_chat_and_plain_prompts_and_overlong_policy(tok):
    rows = [{"prompt": [{"role": "user", "content": "say one"}]}, {"prompt": "one two three four five six"}]
    kept, dropped = tokenize_prompts(rows, tok, prompt_column="prompt", max_prompt_length=5, overlong_prompts="filter")
    assert dropped == 1 and kept[0].text == "<user> say one <assistant>" and len(kept[0].ids) == 4
    with pytest.raises(DataError, match="prompt 1 has 6 tokens > data.max_prompt_length=5"):
        tokenize_prompts(rows, tok, prompt_column="prompt", max_prompt_length=5, overlong_prompts="error")
    with pytest.raises(DataError, match="not a column"):
        tokenize_prompts(rows, tok, prompt_column="question", max_prompt_length=5, overlong_prompts="error")


def test_cursor_epochs_and_resume(tok):
    prompts, _ = tokenize_prompts([{"prompt": f"say {w}"} for w in "one two three".split()], tok,
                                  prompt_column="prompt", max_prompt_length=8, overlong_prompts="error")
    a = PromptCursor(prompts, seed=1, shuffle=True)
    first = [p.text for p in a.take(4)]
    assert sorted(first[:3]) == ["say one", "say three", "say two"]
    b = PromptCursor(prompts, seed=1, shuffle=True)
    b.take(2)
    c = PromptCursor(prompts, seed=1, shuffle=True)
    c.load_state_dict(b.state_dict())
    assert [p.text for p in c.take(5)] == [p.text for p in b.take(5)]
