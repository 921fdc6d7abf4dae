"""The hf engine under mixed precision (bf16 autocast over float32 masters, ddp's): it decodes a bf16 copy of the
weights on the preallocated cache and the lean step (autocast's mixed dtypes used to force the growing cache and the
full forward), samples what a bf16 model samples, and refreshes the copy after an optimizer step."""

from __future__ import annotations

import dataclasses
import copy

import pytest
import torch

from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf.decode import decode
from grpo_cli.rollout.hf.engine import GenerationCopy, HFEngine
from grpo_cli.rollout.seeds import request_seed

PROMPTS = [[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]]
SAMPLING = SamplingParams(n=2, max_tokens=8, temperature=0.9, seed=3)


@pytest.fixture
def model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


def counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = decode_mod.decode_sample
    monkeypatch.setattr(decode_mod, "decode_sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_autocast_generation_runs_the_lean_step_on_a_bf16_copy(model, monkeypatch):
    calls = counting(monkeypatch)
    engine = HFEngine(model, eos_token_ids=[1], pad_token_id=0, shares_policy_weights=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batch = engine.generate(PROMPTS, SAMPLING)
    assert calls, "under autocast the decode fell back to the full forward"
    assert next(model.parameters()).dtype == torch.float32  # the masters are untouched
    reference = copy.deepcopy(model).to(torch.bfloat16).eval()
    reference.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq  # the copy keeps float32 buffers
    seeded = dataclasses.replace(SAMPLING, seed=request_seed(SAMPLING.seed, rank=0, prompt=0))  # as HFEngine seeds
    out = decode(reference, PROMPTS, seeded, eos_token_ids=[1], pad_token_id=0)
    lengths = out.lengths.tolist()
    assert batch.completion_ids == [row[:n] for row, n in zip(out.tokens.tolist(), lengths, strict=True)]


@pytest.mark.parametrize("kind", ["foreach", "fused"])  # a fused step bumps no version counter
def test_the_copy_follows_the_optimizer_step(model, kind):
    engine = HFEngine(model, eos_token_ids=[1], pad_token_id=0, shares_policy_weights=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.generate(PROMPTS, SAMPLING)
    gen_copy = engine._copy
    assert isinstance(gen_copy, GenerationCopy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})
    ids = torch.tensor([[3, 4, 5, 6]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.generate(PROMPTS, SAMPLING)
    assert engine._copy is gen_copy  # refreshed in place, not rebuilt
    for (name, p), (_, q) in zip(model.named_parameters(), gen_copy.model.named_parameters(), strict=True):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.detach().to(torch.bfloat16)), name


def test_without_autocast_the_engine_decodes_the_policy_itself(model):
    engine = HFEngine(model, eos_token_ids=[1], pad_token_id=0, shares_policy_weights=True)
    assert engine.generation_model()[0] is model
    engine.generate(PROMPTS, SAMPLING)
    assert engine._copy is None
