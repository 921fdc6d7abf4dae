"""The hf decode loop makes the host wait for the device a bounded number of times per decode, not per step: step
t's stops are recorded with index copies (no boolean-mask indexing, whose `nonzero` waits), the finished count is
the one value read per step (`decode.FinishedCount`), and where the lean step `runs_ahead` (CUDA) step t + 1 is
launched before that count is read. Speculating so draws the same tokens as reading first: when rows are dropped
after step t, step t + 1 runs again from the generator's earlier state."""

from __future__ import annotations

import collections

import pytest
import torch

from grpo_cli.models.attention import attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.rollout.hf import decode_step
from grpo_cli.rollout.hf.decode import decode

PROMPTS = [[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]]
EOS = [24, 28, 58]  # frequent under this random model: rows stop at many different steps
NEVER = [10**6]  # not a token: no row stops
WAITING = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero")  # a device→host read


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2") / "ckpt", hidden_size=128, arch="qwen2")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_implementation("sdpa")).eval()


def sample(model, *, steps: int = 12, eos=EOS, keep: bool = False, seed: int = 7):
    return decode(model, PROMPTS, SamplingParams(n=3, max_tokens=steps, temperature=0.9, seed=seed),
                  eos_token_ids=eos, pad_token_id=0, keep=keep)


@pytest.mark.parametrize("fraction", [0.0, 0.25])
@pytest.mark.parametrize("seed", [7, 11])
def test_running_ahead_samples_what_reading_the_count_first_samples(model, monkeypatch, fraction, seed):
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", fraction)
    first = sample(model, keep=True, seed=seed)
    monkeypatch.setattr(decode_mod, "runs_ahead", lambda device: True)
    ahead = sample(model, keep=True, seed=seed)
    assert 0 < int(first.stopped.sum()) < len(first.stopped)  # rows were dropped mid-decode
    for a, b in zip((ahead.tokens, ahead.logprobs, ahead.lengths, ahead.stopped),
                    (first.tokens, first.logprobs, first.lengths, first.stopped), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ahead.kept, first.kept, strict=True):
        assert (a.length, a.last_token) == (b.length, b.last_token)
        mine = a.batch.mask[a.index].bool()
        assert torch.equal(mine, b.batch.mask[b.index].bool())
        for x, y in zip(a.batch.keys + a.batch.values, b.batch.keys + b.batch.values, strict=True):
            assert torch.equal(x[a.index][:, mine], y[b.index][:, mine])


def waits(model, monkeypatch, **kwargs) -> tuple[int, int]:
    """(ops of one decode that read a device value on the host, each one a wait for the device on CUDA; the times
    the decode dropped finished rows)."""
    compactions = []
    real = decode_mod.StaticStep.compact
    monkeypatch.setattr(decode_mod.StaticStep, "compact", lambda self, keep: (compactions.append(1), real(self, keep)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample(model, **kwargs)
    counts = collections.Counter(e.name for e in prof.events())
    return sum(counts[name] for name in WAITING), len(compactions)


def test_host_reads_do_not_grow_with_the_steps(model, monkeypatch):
    """Besides the finished count, read through `FinishedCount` once a step (and on CUDA without waiting for the
    step launched since), a decode reads device values a fixed number of times (prefill, seeding), plus a few per
    compaction for the kept rows' KV. Before, each step read two boolean masks' sizes and the count."""
    monkeypatch.setattr(decode_mod, "runs_ahead", lambda device: True)
    short, _ = waits(model, monkeypatch, steps=6, eos=NEVER)
    long, _ = waits(model, monkeypatch, steps=30, eos=NEVER)
    assert short == long <= 3, (short, long)  # 27 and 123 before
    stopping, compactions = waits(model, monkeypatch, steps=30)
    assert compactions > 1 and stopping <= 3  # rows stop and are dropped: argsort by done, no nonzero
    kept, compactions = waits(model, monkeypatch, steps=30, keep=True)
    assert kept <= 3 + 3 * (compactions + 1), (kept, compactions)  # stashing rows reads their lengths and tokens


def test_running_ahead_launches_the_next_step_before_reading_the_count(model, monkeypatch):
    monkeypatch.setattr(decode_mod, "runs_ahead", lambda device: True)
    events: list[str] = []
    real_step, real_put, real_read = decode_step.decode_sample, decode_mod.FinishedCount.put, \
        decode_mod.FinishedCount.read

    def step(*args, **kwargs):
        events.append("step")
        return real_step(*args, **kwargs)

    def put(self, done):
        events.append("put")
        return real_put(self, done)

    def read(self):
        events.append("read")
        return real_read(self)

    monkeypatch.setattr(decode_mod, "decode_sample", step)
    monkeypatch.setattr(decode_mod.FinishedCount, "put", put)
    monkeypatch.setattr(decode_mod.FinishedCount, "read", read)
    out = sample(model, steps=20)
    trace = "".join(e[0] for e in events)  # s(tep) p(ut) r(ead)
    assert trace.count("r") == trace.count("p") > 5
    assert "pr" not in trace  # a step was launched between every put and its read
    redone = trace.count("rs")  # a step launched again after the read: rows were dropped
    assert 0 < redone < trace.count("r")
    assert int(out.stopped.sum()) > 0
