"""Multi-turn rollouts on the hf engine keep each row's KV between turns (`HFEngine.continue_rows`) and read only
the new tokens: the same ids as re-reading the whole conversation each turn, and logprobs equal to the trainer's
over the whole sequence, on the tiny Llama, Qwen2 (tied, q/k/v biases), Qwen3 (q/k norms) and Gemma."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_cli.agent.rollout import wrap_engine
from grpo_cli.config.agent import AgentConfig
from grpo_cli.rollout.base import RolloutEngine, SamplingParams
from grpo_cli.rollout.hf.engine import HFEngine
from grpo_cli.models.logprobs import score_sequences

TOOLS = str(Path(__file__).parents[1] / "agent" / "tools_for_tests.py")
PROMPTS = [[3, 4, 6, 7, 8, 5], [3, 9, 10, 5], [3, 4, 11, 12, 13, 14, 15, 5]]


class Rereads(RolloutEngine):
    """The engine without `continue_rows`: every turn re-reads the conversation as a prompt."""

    def __init__(self, engine) -> None:
        self.inner = engine

    def generate(self, prompt_ids, sampling):
        return self.inner.generate(prompt_ids, sampling)

    def __getattr__(self, name):
        if name in ("inner", "continue_rows"):
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma"])
def test_kept_kv_turns_match_rereading_and_the_trainer(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_cli.models.tiny import build_tiny_checkpoint

    build_tiny_checkpoint(tmp_path, arch=arch, tools=True)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    stops = list(range(20, 20 + len(tok) // 4))  # many stop tokens: turns end early, at different steps
    engine = HFEngine(model, eos_token_ids=stops, pad_token_id=tok.pad_token_id, shares_policy_weights=True)
    resumed = []
    original = engine.continue_rows
    engine.continue_rows = lambda rows, new, sampling: resumed.append(len(rows)) or original(rows, new, sampling)
    cfg = AgentConfig(tools=[f"{TOOLS}:add"], tool_parser=f"{TOOLS}:always_add", max_turns=4,
                      tool_isolation="inline")
    sampling = SamplingParams(n=4, max_tokens=48, seed=5)
    kept = wrap_engine(engine, cfg, tok).generate(PROMPTS, sampling)
    reread = wrap_engine(Rereads(engine), cfg, tok).generate(PROMPTS, sampling)
    assert resumed and sum(resumed) > len(PROMPTS) * 4  # later turns ran on kept KV, several rows each
    assert kept.metrics["tools/turns"] > 2
    assert kept.completion_ids == reread.completion_ids and kept.loss_masks == reread.loss_masks
    diff = max(abs(a - b) for x, y in zip(kept.sampler_logprobs, reread.sampler_logprobs, strict=True)
               for a, b in zip(x, y, strict=True))
    assert diff < 1e-5, diff
    sequences = [PROMPTS[j // 4] + ids for j, ids in enumerate(kept.completion_ids)]
    trainer = score_sequences(model, sequences, pad_token_id=tok.pad_token_id)
    worst = 0.0
    for j, (ids, mask, lps) in enumerate(zip(kept.completion_ids, kept.loss_masks, kept.sampler_logprobs,
                                             strict=True)):
        start = len(PROMPTS[j // 4]) - 1  # score of token i of the sequence sits at i − 1
        for i, (m, lp) in enumerate(zip(mask, lps, strict=True)):
            if m:
                worst = max(worst, abs(lp - trainer[j][start + i]))
    assert worst < 1e-4, worst
    assert engine._kept is None  # the agent loop let the cache go
