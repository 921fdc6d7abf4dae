"""A multi-turn rollout (`agent:`, `rollout.custom`) on the colocated vLLM engine with sleep on: the engine is held
awake across the turns of one rollout and sleeps once, after the last (issue 36). The `VLLMEngine` methods are the
real ones around a stand-in for `vllm.LLM` that answers each generation with the next scripted turn."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm_fakes import FakeLLM, bare_engine

from grpo_cli.agent.custom import CustomRollout
from grpo_cli.agent.rollout import wrap_engine
from grpo_cli.config.agent import AgentConfig
from grpo_cli.rollout.base import SamplingParams, held_awake

pytest.importorskip("vllm")  # the engine builds vllm.SamplingParams
CALL = '<tool_call> {"name": "calculator", "arguments": {"a": 2, "b": 3}} </tool_call> <eos>'


class ScriptedLLM(FakeLLM):
    """Generation k answers every request with `turns[k % len(turns)]`."""

    def __init__(self, turns: list[list[int]]):
        super().__init__()
        self.turns, self.generations = turns, 0

    def generate(self, requests, params, use_tqdm=False):
        ids = self.turns[self.generations % len(self.turns)]
        self.generations += 1
        self.calls.append(("generate",))
        sample = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
        return [SimpleNamespace(prompt_logprobs=None, outputs=[
            SimpleNamespace(index=i, token_ids=list(ids), finish_reason="stop", logprobs=sample) for i in range(p.n)])
            for p in params]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from grpo_cli.models.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tools-tok"), tools=True)


def _agent_on_vllm(tok, level: int):
    ids = tok.encode(CALL, add_special_tokens=False), tok.encode("5 <eos>", add_special_tokens=False)
    llm = ScriptedLLM(list(ids))
    engine = bare_engine(llm, sleep_level=level)
    return llm, engine, wrap_engine(engine, AgentConfig(tools=["calculator"], tool_isolation="inline"), tok)


def test_a_two_turn_rollout_at_sleep_level_2_runs_and_sleeps_once(tok):
    """Step 1's rollout (2 turns), the sync, step 2's rollout (2 turns): one sleep per rollout, the KV cache woken
    once per rollout. Before, turn 2 raised "slept at level 2 (weights discarded)"."""
    llm, engine, agent = _agent_on_vllm(tok, level=2)
    prompt = tok.encode("what is two plus three ?", add_special_tokens=False)
    out = agent.generate([prompt], SamplingParams(n=2, max_tokens=60, seed=1))
    assert out.metrics["tools/turns"] == 2.0 and llm.generations == 2
    assert llm.sleeps() == [2] and engine._asleep == {"weights", "kv_cache"}
    engine.update_weights([], 1)  # the step's sync: wakes the weights
    out = agent.generate([prompt], SamplingParams(n=2, max_tokens=60, seed=2))
    assert out.weight_version == 1 and llm.generations == 4
    assert llm.sleeps() == [2, 2] and llm.wakes() == [("weights",), ("kv_cache",)]


def test_at_sleep_level_1_the_turns_keep_the_weights_and_prefix_cache(tok):
    llm, engine, agent = _agent_on_vllm(tok, level=1)
    prompt = tok.encode("what is two plus three ?", add_special_tokens=False)
    agent.generate([prompt], SamplingParams(n=1, max_tokens=60, seed=1))
    agent.generate([prompt], SamplingParams(n=1, max_tokens=60, seed=2))
    assert llm.generations == 4 and llm.sleeps() == [1, 1]  # was [1, 1, 1, 1]: every turn offloaded the weights
    assert llm.wakes() == [("weights", "kv_cache")]


def test_a_custom_rollout_holds_the_engine_awake_across_its_calls(tok):
    llm = ScriptedLLM([[7, 1]])
    engine = bare_engine(llm, sleep_level=2)

    def twice(*, engine, prompt_ids, sampling, tokenizer):
        first = engine.generate(prompt_ids, sampling)
        again = engine.generate([p + c for p, c in zip(prompt_ids, first.completion_ids, strict=True)], sampling)
        return [{"ids": c + d, "mask": [1] * len(c + d), "logprobs": [-0.5] * len(c + d)}
                for c, d in zip(first.completion_ids, again.completion_ids, strict=True)]

    custom = CustomRollout(engine, twice, tok, "tests:twice")
    out = custom.generate([[3, 4]], SamplingParams(n=1, max_tokens=4, seed=1))
    assert out.completion_ids == [[7, 1, 7, 1]] and llm.sleeps() == [2]


def test_a_wrapper_passes_the_hold_on_and_an_engine_without_one_gets_a_plain_block(tok):
    llm, engine, agent = _agent_on_vllm(tok, level=2)
    with held_awake(agent):  # e.g. an evaluation holding the engine across several rollouts
        agent.generate([[3, 4]], SamplingParams(n=1, max_tokens=60, seed=1))
        assert llm.sleeps() == []
    assert llm.sleeps() == [2]
    with held_awake(SimpleNamespace()):  # the contract's default: nothing to hold
        pass
