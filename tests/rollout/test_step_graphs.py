"""The hf engine's CUDA graphs across generations (issue 46, 4.6), driven on the CPU through `graph_fakes` (the
decode runs for real; CUDA's graph object is faked): each bucket is captured once and replayed by the next
`generate` of the same shape, with the weights of the last in-place update; a capture empties no cache; the
static step takes the cache's own tensors when no row is padded."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from graph_fakes import FakeGraph, fake_cuda
from grpo_cli.models.attention import attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.rollout.hf.decode import decode
from grpo_cli.rollout.hf.engine import HFEngine
from grpo_cli.rollout.hf.static_step import StaticStep
from grpo_cli.rollout.seeds import request_seed

PROMPTS = [[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]]
EOS = [24, 28, 58]


def sampling(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(n=3, max_tokens=max_tokens, temperature=0.9, seed=seed)


@pytest.fixture
def model(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "ckpt", hidden_size=64, arch="qwen2")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_implementation("sdpa")).eval()


def full_forward(model, monkeypatch, params: SamplingParams) -> tuple[list[list[int]], torch.Tensor]:
    """The completions of the full forward (no lean step, no graph), cut at their lengths, and their logprobs."""
    params = dataclasses.replace(params, seed=request_seed(params.seed, rank=0, prompt=0))  # as HFEngine seeds rank 0
    with monkeypatch.context() as m:
        m.setattr(decode_mod, "decoder_parts", lambda model: None)
        out = decode(model, PROMPTS, params, eos_token_ids=EOS, pad_token_id=0)
    lengths = out.lengths.tolist()
    return ([row[:n] for row, n in zip(out.tokens.tolist(), lengths, strict=True)],
            torch.cat([row[:n] for row, n in zip(out.logprobs, lengths, strict=True)]))


def same(batch, reference) -> bool:
    """Whether an engine's batch holds the reference's completions and logprobs (to float rounding)."""
    tokens, logprobs = reference
    return batch.completion_ids == tokens and torch.allclose(
        torch.tensor([x for row in batch.sampler_logprobs for x in row]), logprobs, atol=1e-5)


def test_generates_of_one_shape_capture_each_bucket_once(model, monkeypatch):
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", 0.0)
    fake_cuda(monkeypatch)
    engine = HFEngine(model, eos_token_ids=EOS, pad_token_id=0, shares_policy_weights=True)
    first = engine.generate(PROMPTS, sampling(7))
    captured = len(FakeGraph.made)
    assert captured > 1 and same(first, full_forward(model, monkeypatch, sampling(7)))
    replays = sum(g.replays for g in FakeGraph.made)
    assert same(engine.generate(PROMPTS, sampling(8)), full_forward(model, monkeypatch, sampling(8)))
    with torch.no_grad():  # an optimizer step: the weights change in place, the graphs read them (and the fused copies)
        for p in model.parameters():
            p.mul_(1.05)
    # seeds whose rows finish into the buckets the first generate captured (a row count not seen yet is a new bucket
    # and captures, rightly): 8 and 10 under `rollout/seeds.py`'s hash
    third = engine.generate(PROMPTS, sampling(10))
    assert len(FakeGraph.made) == captured  # the second and third generate captured nothing
    assert sum(g.replays for g in FakeGraph.made) > replays
    assert same(third, full_forward(model, monkeypatch, sampling(10)))
    engine.generate(PROMPTS, sampling(9, max_tokens=10))  # another cache length: captured again
    assert len(FakeGraph.made) > captured
    captured = len(FakeGraph.made)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # new tensors: the graphs go
    assert same(engine.generate(PROMPTS, sampling(9, max_tokens=10)),
                full_forward(model, monkeypatch, sampling(9, max_tokens=10)))
    assert len(FakeGraph.made) > captured
    engine.sleep(1)
    assert engine._steps._held is None  # sleep hands the graphs' memory and KV buffers back


def test_a_capture_empties_no_cache(model, monkeypatch):
    calls = fake_cuda(monkeypatch)
    decode(model, PROMPTS, sampling(7), eos_token_ids=EOS, pad_token_id=0)
    assert FakeGraph.made and calls.flushes == []


def test_the_static_step_copies_no_cache_when_no_row_is_padded():
    def cache(rows: int):
        layer = lambda: types.SimpleNamespace(keys=torch.randn(rows, 2, 8, 4), values=torch.randn(rows, 2, 8, 4))
        return types.SimpleNamespace(layers=[layer(), layer()])

    full = cache(6)  # a bucket size: no padding row
    keys = [layer.keys.untyped_storage().data_ptr() for layer in full.layers]
    step = StaticStep(None, None, full, vocab=16, tensor_slot=False)
    assert [k.untyped_storage().data_ptr() for k in step.keys] == keys
    padded = cache(5)  # bucket 6: one padding row, so one copy
    rows = padded.layers[0].keys
    step = StaticStep(None, None, padded, vocab=16, tensor_slot=False)
    assert step.keys[0].shape[0] == 6 and torch.equal(step.keys[0][:5], rows)
    assert step.keys[0].untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
