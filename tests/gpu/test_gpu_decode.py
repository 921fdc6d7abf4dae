"""The hf engine's decode loop on CUDA (what the CPU tests of `tests/rollout/test_decode_syncs.py` cannot run): with
the steps captured as CUDA graphs and the next step launched before the finished count is read, it samples what
reading the count first samples (the CUDA generator set back when rows are dropped after all), and the host's waits
for the whole stream (`cudaStreamSynchronize`, `cudaDeviceSynchronize`) do not grow with the number of steps; the
engine's next `generate` of the same shape replays the graphs the first captured."""

from __future__ import annotations

import collections

import pytest
import torch
from gpu_helpers import DEVICE

from grpo_cli.models.attention import attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf import lookahead
from grpo_cli.rollout.hf.decode import decode

PROMPTS = [[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]]
EOS = [24, 28, 58]
STREAM_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2") / "ckpt", hidden_size=128, arch="qwen2")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_implementation("sdpa")).eval().to(DEVICE)


def sample(model, steps: int = 24, eos=EOS):
    out = decode(model, PROMPTS, SamplingParams(n=8, max_tokens=steps, temperature=0.9, seed=7), eos_token_ids=eos,
                 pad_token_id=0)
    return [t.cpu() for t in (out.tokens, out.logprobs, out.lengths, out.stopped)]


def test_launching_first_on_cuda_samples_what_reading_first_samples(model, monkeypatch):
    monkeypatch.setattr(lookahead, "runs_ahead", lambda device: False)
    first = sample(model)
    assert 0 < int(first[3].sum()) < len(first[3])
    monkeypatch.setattr(lookahead, "runs_ahead", lambda device: True)
    for risk in (lookahead.RISK, 1.0):  # 1: every step launched before its count is read
        monkeypatch.setattr(lookahead, "RISK", risk)
        assert all(torch.equal(a, b) for a, b in zip(sample(model), first, strict=True)), risk


def test_stream_waits_do_not_grow_with_the_steps(model):
    def waits(steps: int) -> int:
        sample(model, steps, eos=[10**6])  # warm; no row stops: one bucket, captured once per decode
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            sample(model, steps, eos=[10**6])
        counts = collections.Counter(e.name for e in prof.events())
        return sum(counts[name] for name in STREAM_WAITS)

    short, long = waits(6), waits(30)
    assert short == long, (short, long)


def test_generates_of_one_shape_replay_the_first_ones_graphs(model, monkeypatch):
    """The hf engine keeps each bucket's CUDA graph for its next decode of the same shape (`static_step.StepStore`):
    the second and third `generate` capture nothing, no capture empties the allocator's cache, and the third (the
    first's seed again) samples the first's tokens from the replayed graphs."""
    from grpo_cli.rollout.hf.engine import HFEngine

    captures, flushes = [], []

    class Counted(torch.cuda.CUDAGraph):
        def capture_begin(self, *args, **kwargs):
            captures.append(1)
            return super().capture_begin(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Counted)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: flushes.append(1))
    engine = HFEngine(model, eos_token_ids=EOS, pad_token_id=0, shares_policy_weights=True)
    params = [SamplingParams(n=8, max_tokens=24, temperature=0.9, seed=seed) for seed in (7, 8, 7)]
    first = engine.generate(PROMPTS, params[0])
    captured = len(captures)
    engine.generate(PROMPTS, params[1])
    again = engine.generate(PROMPTS, params[2])
    assert len(captures) == captured and flushes == []
    assert again.completion_ids == first.completion_ids
    if DEVICE == "cuda":
        assert captured > 1  # one graph per bucket the first decode ran
