"""The lean decode step at static shapes (`rollout.static_step`): active rows padded to a bucket, finished rows
compacted in place into the next smaller bucket, the same tokens as the full forward for a fixed seed; on CUDA each
bucket's step is captured once as a CUDA graph and replayed (driven here with torch.cuda's graph calls faked:
`graph_fakes`); a compiled step compiles at most once per bucket and not again for the next decode."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.rollout.hf import decode_step
from grpo_cli.models.attention import attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf.decode import decode
from grpo_cli.rollout.hf.static_step import bucket_size
from graph_fakes import FakeGraph, fake_cuda

PROMPTS = [[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]]
SAMPLING = SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=7)  # 12 rows
EOS = [24, 28, 58]  # frequent under this random model: rows stop at many different steps
BUCKETS = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2") / "ckpt", hidden_size=128, arch="qwen2")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_implementation("sdpa")).eval()


def test_bucket_sizes():
    assert [bucket_size(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 25, 33, 100, 128)] == \
        [1, 2, 3, 4, 6, 6, 8, 12, 16, 24, 32, 48, 128, 128]
    assert {bucket_size(n) for n in range(1, 129)} == BUCKETS


def shapes_of_steps(monkeypatch) -> list[tuple[int, int]]:
    """(batch the step ran, rows active) of every lean step."""
    seen: list[tuple[int, int]] = []
    real = decode_step.decode_sample

    def counted(plan, keys, values, tokens, *args, **kwargs):
        seen.append(tokens.shape[0])
        return real(plan, keys, values, tokens, *args, **kwargs)

    monkeypatch.setattr(decode_mod, "decode_sample", counted)
    return seen


def full_forward(model, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(decode_mod, "decoder_parts", lambda model: None)
        return decode(model, PROMPTS, SAMPLING, eos_token_ids=EOS, pad_token_id=0)


@pytest.mark.parametrize("fraction", [0.0, 0.25])
def test_bucketed_steps_sample_the_tokens_of_the_full_forward(model, monkeypatch, fraction):
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", fraction)
    full = full_forward(model, monkeypatch)
    seen = shapes_of_steps(monkeypatch)
    lean = decode(model, PROMPTS, SAMPLING, eos_token_ids=EOS, pad_token_id=0)
    assert seen and set(seen) <= BUCKETS, seen
    assert len(set(seen)) > 1  # rows stopped and were compacted into a smaller bucket
    assert 0 < int(lean.stopped.sum()) < len(lean.stopped)
    assert torch.equal(lean.lengths, full.lengths) and torch.equal(lean.tokens, full.tokens)
    assert torch.allclose(lean.logprobs, full.logprobs, atol=1e-5)


def test_each_bucket_is_captured_once_and_replayed_on_cuda(model, monkeypatch):
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", 0.0)
    full = full_forward(model, monkeypatch)
    calls = fake_cuda(monkeypatch)
    out = decode(model, PROMPTS, SAMPLING, eos_token_ids=EOS, pad_token_id=0)
    batches = [g.batch for g in FakeGraph.made]
    assert len(batches) == len(set(batches)) > 1 and set(batches) <= BUCKETS  # one capture per bucket
    assert calls.warmup == 2 * len(batches)  # warmed up on the side stream before each capture
    assert all(g.replays > 0 for g in FakeGraph.made)
    assert all(g.pool_given == FakeGraph.made[0].pool() for g in FakeGraph.made[1:])  # one memory pool
    assert torch.equal(out.tokens, full.tokens) and torch.allclose(out.logprobs, full.logprobs, atol=1e-5)


def test_the_compiled_step_compiles_at_most_once_per_bucket(model, monkeypatch):
    """Counted with a counting backend (eager code, no inductor): the first decode compiles at most once per bucket
    it runs; a second decode (another seed, other rows stopping) compiles nothing."""
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", 0.0)
    torch._dynamo.reset()
    compiles: list[int] = []

    def backend(graph_module, example_inputs):
        compiles.append(1)
        return graph_module.forward

    compiled = torch.compile(decode_step.decode_sample, backend=backend)
    monkeypatch.setattr(decode_mod, "compiled_decode_sample", lambda: compiled)
    seen = shapes_of_steps(monkeypatch)  # eager reference only: the compiled step is not wrapped
    eager = decode(model, PROMPTS, SAMPLING, eos_token_ids=EOS, pad_token_id=0)
    buckets = set(seen)
    out = decode(model, PROMPTS, SAMPLING, eos_token_ids=EOS, pad_token_id=0, compile_step=True)
    assert torch.equal(out.tokens, eager.tokens)
    assert 1 <= len(compiles) <= len(buckets), (len(compiles), buckets)
    first = len(compiles)
    decode(model, PROMPTS[:3], SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=8), eos_token_ids=EOS,
           pad_token_id=0, compile_step=True)
    assert len(compiles) == first
    torch._dynamo.reset()


def test_a_step_cuda_cannot_capture_runs_uncaptured(model, monkeypatch):
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", 0.0)
    full = full_forward(model, monkeypatch)

    class Refused:
        def __init__(self, fn, device, **kwargs) -> None:
            if device is not None:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.fn = fn

        def __call__(self):
            return self.fn()

        def pool(self):
            return None

    monkeypatch.setattr(decode_mod, "is_cuda", lambda device: True)
    from grpo_cli.rollout.hf import static_step

    monkeypatch.setattr(static_step, "StepGraph", Refused)
    with pytest.warns(RuntimeWarning, match="could not be captured as a CUDA graph"):
        out = decode(model, PROMPTS, SAMPLING, eos_token_ids=EOS, pad_token_id=0)
    assert torch.equal(out.tokens, full.tokens)
