"""The hf decode loop makes the host wait for the device a bounded number of times per decode, not per step: step
t's stops are recorded with index copies (no boolean-mask indexing, whose `nonzero` waits), the finished count is
the one value read per step (`lookahead.FinishedCount`), and where the lean step `runs_ahead` (CUDA) step t + 1 is
launched before that count is read unless rows are likely to be dropped. Launching first draws the same tokens as
reading first: when rows are dropped after step t, step t + 1 runs again from the generator's earlier state."""

from __future__ import annotations

import collections

import pytest
import torch

from grpo_cli.models.attention import attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.rollout.hf import decode_step, lookahead
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
@pytest.mark.parametrize("risk", [1.0, lookahead.RISK])  # 1: every step launched before the count is read
def test_running_ahead_samples_what_reading_the_count_first_samples(model, monkeypatch, fraction, seed, risk):
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", fraction)
    first = sample(model, keep=True, seed=seed)
    monkeypatch.setattr(lookahead, "runs_ahead", lambda device: True)
    monkeypatch.setattr(lookahead, "RISK", risk)
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
    """Besides the finished count, read through `FinishedCount` once a step (on CUDA mostly after the next step was
    launched), a decode reads device values a fixed number of times (prefill, seeding), plus a few per
    compaction for the kept rows' KV. Before, each step read two boolean masks' sizes and the count."""
    monkeypatch.setattr(lookahead, "runs_ahead", lambda device: True)
    short, _ = waits(model, monkeypatch, steps=6, eos=NEVER)
    long, _ = waits(model, monkeypatch, steps=30, eos=NEVER)
    assert short == long <= 3, (short, long)  # 27 and 123 before
    stopping, compactions = waits(model, monkeypatch, steps=30)
    assert compactions > 1 and stopping <= 3  # rows stop and are dropped: argsort by done, no nonzero
    kept, compactions = waits(model, monkeypatch, steps=30, keep=True)
    assert kept <= 3 + 3 * (compactions + 1), (kept, compactions)  # stashing rows reads their lengths and tokens


def test_the_next_step_is_launched_before_the_count_unless_rows_are_likely_dropped(model, monkeypatch):
    monkeypatch.setattr(lookahead, "runs_ahead", lambda device: True)
    events: list[str] = []
    real_step, real_put, real_read = decode_step.decode_sample, lookahead.FinishedCount.put, \
        lookahead.FinishedCount.read
    monkeypatch.setattr(decode_mod, "decode_sample", lambda *a, **k: (events.append("step"), real_step(*a, **k))[1])
    monkeypatch.setattr(lookahead.FinishedCount, "put", lambda self, done: (events.append("put"),
                                                                             real_put(self, done))[1])
    monkeypatch.setattr(lookahead.FinishedCount, "read", lambda self, rows: (events.append("read"),
                                                                              real_read(self, rows))[1])

    def trace(**kwargs) -> str:
        events.clear()
        sample(model, steps=20, **kwargs)
        return "".join(e[0] for e in events)  # s(tep) p(ut) r(ead)

    never = trace(eos=NEVER)
    assert never.count("psr") == never.count("r") == 19  # no row stops: every step launched before the read
    stopping = trace()  # rows stop at nearly every step here, so a drop is often likely
    assert stopping.count("psr") > 0 and stopping.count("pr") > 0
    assert stopping.count("psrs") <= 2  # a launched step ran again: rows were dropped after all


def test_the_chance_of_a_drop():
    assert lookahead.at_least(0, 5, 0.0) == 1.0 and lookahead.at_least(1, 5, 0.0) == 0.0
    assert lookahead.at_least(6, 5, 0.5) == 0.0 and lookahead.at_least(5, 5, 1.0) == 1.0
    assert lookahead.at_least(1, 3, 0.5) == pytest.approx(7 / 8)
    assert lookahead.at_least(2, 3, 0.5) == pytest.approx(4 / 8)
    assert 0.0 < lookahead.at_least(600, 2048, 0.25) < 1e-3  # no overflow at thousands of rows
    count = lookahead.FinishedCount(torch.device("cpu"))
    assert count.launch_first(rows=128, threshold=32)  # no stop seen: launch first
    count.put(torch.arange(128) < 4)
    assert count.read(128) == 4 and count.launch_first(rows=128, threshold=32)  # 4 of 128 stopped: 28 more unlikely
    count.put(torch.arange(128) < 30)
    assert count.read(128) == 30 and not count.launch_first(rows=128, threshold=32)  # 2 more likely
    count.dropped()
    assert count.launch_first(rows=98, threshold=24.5)


def test_host_readback_cuda_branch_waits_on_its_event_only(monkeypatch):
    """The CUDA branch of `accel.HostReadback` (the finished count's read) on CPU with the CUDA calls patched: the
    value goes into the (here unpinned) host buffer with non_blocking, an event is recorded behind the copy, and
    `get` waits on that event before reading; on the CPU no event is made."""
    from grpo_cli.runtime import accel

    calls = []

    class Event:
        def record(self):
            calls.append("record")

        def synchronize(self):
            calls.append("synchronize")

    copies = []
    real_host_copy = accel.host_copy
    monkeypatch.setattr(accel, "stream_event", lambda device: Event() if accel.is_cuda(device) else None)
    monkeypatch.setattr(accel, "host_copy",
                        lambda t, *, pinned: copies.append(pinned) or real_host_copy(t, pinned=False))
    readback = accel.HostReadback(torch.device("cuda"))
    assert copies == [True]  # asked for pinned memory, as an asynchronous device → host copy needs
    readback.put(torch.tensor(7))
    assert calls == ["record"]
    assert readback.get() == 7 and calls == ["record", "synchronize"]
    cpu = accel.HostReadback(torch.device("cpu"))
    cpu.put(torch.tensor(3))
    assert cpu.event is None and cpu.get() == 3
