"""Tool calls on one rank only: the agent loop's turns are agreed over the engine's tensor-parallel group (every
vLLM `generate` gathers the group's prompts), a rank with nothing left joins each turn with an empty call, and
each rank still gets the completions of its own prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks
from tool_calls_worker import MAX_TOKENS, PROMPTS

from grpo_cli.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

WORKER = Path(__file__).with_name("tool_calls_worker.py")


class PeerGoesOn(RolloutEngine):
    """One token (`eos`, finish `stop`) per prompt; `agree_any` answers as a TP group whose peer calls a tool for
    `peer_turns` more turns. Records each call's prompt count and max_tokens."""

    shares_policy_weights = True

    def __init__(self, eos: int, peer_turns: int) -> None:
        self.eos, self.peer_turns, self.asked = eos, peer_turns, 0
        self.calls: list[tuple[int, int]] = []

    def agree_any(self, flag: bool) -> bool:
        self.asked += 1
        return flag or self.asked <= self.peer_turns

    def generate(self, prompt_ids, sampling):
        self.calls.append((len(prompt_ids), sampling.max_tokens))
        rows = len(prompt_ids) * sampling.n
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], completion_ids=[[self.eos]] * rows,
                            finish_reasons=["stop"] * rows, sampler_logprobs=[[-0.5]] * rows)


def test_a_rank_without_tool_calls_joins_its_peers_turns_with_empty_calls(tmp_path):
    """This rank's completions call no tool, its peer's call one for two more turns: this rank makes two empty
    `generate` calls (the peer's turns), then stops when the group agrees; its own rollouts keep one turn. Before
    the agreement it stopped after turn 0, and the peer waited in vLLM's gather forever."""
    from grpo_cli.agent.rollout import wrap_engine
    from grpo_cli.config.agent import AgentConfig
    from grpo_cli.models.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok", tools=True)
    engine = PeerGoesOn(tok.eos_token_id, peer_turns=2)
    agent = wrap_engine(engine, AgentConfig(tools=["calculator"], tool_isolation="inline", max_turns=4), tok)
    out = agent.generate([[3, 4], [3, 5]], SamplingParams(n=2, max_tokens=16, seed=1))
    assert engine.calls == [(2, 16), (0, 1), (0, 1)] and engine.asked == 3
    assert out.completion_ids == [[tok.eos_token_id]] * 4 and out.metrics["tools/turns"] == 1.0


@pytest.mark.vllm
@pytest.mark.slow
def test_tool_calls_on_one_rank_of_a_tensor_parallel_vllm_engine(tmp_path):
    """2 ranks, one vLLM engine at TP 2 (external launcher, gloo with a 60 s timeout), the agent loop with a parser
    that calls the calculator on one rank only (each turn is one sampled token ending by `stop`), once with the
    calls on rank 0, once on rank 1; then one direct `generate` with max_tokens 6 on rank 0 and 2 on rank 1. Before
    the fix the non-calling rank left the loop while its peer gathered for the next turn (a hang, failed by the
    timeouts), and each rank applied its own max_tokens to its peer's requests too."""
    pytest.importorskip("vllm")
    from grpo_cli.models.tiny import resolve_model_path

    worker_out = tmp_path / "out"
    worker_out.mkdir()
    results = run_two_ranks(str(WORKER), [resolve_model_path("builtin:tiny-tools")], worker_out, timeout=150)

    for rank, result in enumerate(results):
        for caller, got in enumerate(result["rounds"]):
            rows = 2 * len(PROMPTS[rank])
            assert got["prompts"] == PROMPTS[rank] and got["finish"] == ["stop"] * rows
            turns = 3 if rank == caller else 1  # agent.max_turns on the calling rank, one turn on its peer
            assert got["turns"] == [turns] * rows and got["sampled"] == [turns] * rows
            assert got["tool_results"] == [["5"] * (turns - 1)] * rows
            assert got["gap"] < 1e-4, got  # the sampled tokens are this rank's conversations' own
        direct = result["direct"]
        assert len(direct["lengths"]) == 2 * len(PROMPTS[rank])
        assert all(n == MAX_TOKENS[rank] if why == "length" else n <= MAX_TOKENS[rank]
                   for n, why in zip(direct["lengths"], direct["finish"], strict=True)), direct
        assert "length" in direct["finish"], direct
