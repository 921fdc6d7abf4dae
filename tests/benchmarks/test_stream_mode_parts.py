"""benchmarks/stream_mode.py's workload and summary: the checkpoint samples every next token uniformly (so the
completion lengths are geometric, mean ~V, up to 512 after the prompt), and an arm's summary reads the right phases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` is not installed

from benchmarks.stream_mode_parts import CALIBRATION, fit_decode, split, summarise_arm, workload_checkpoint  # noqa: E402


def test_workload_checkpoint_samples_uniformly_over_a_long_context(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = workload_checkpoint(tmp_path, None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.max_position_embeddings == 1024
    ids = torch.randint(0, model.config.vocab_size, (1, 600))
    probs = model(ids).logits.softmax(-1)
    assert torch.allclose(probs, torch.full_like(probs, 1 / model.config.vocab_size))  # EOS at 1/V everywhere
    assert workload_checkpoint(tmp_path, None) == path  # built once


def rows(step, generate, lengths, **extra):
    return [{"time/step": step, "time/generate": generate, "time/sync": 0.1, "completions/mean_length": n,
             "reward/mean": 0.5, **extra} for n in lengths]


def test_summary_counts_trained_tokens_and_each_modes_idle_time():
    sync = summarise_arm([{"rows": rows(2.0, 1.5, [10, 20, 30, 40])}], skip=1, batch=4, prompt_len=5)
    assert sync["tokens_per_s"] == pytest.approx((20 + 30 + 40) * 4 / 6.0)  # the first row left out
    assert sync["engine_idle_frac"] == pytest.approx(0.25)  # the server generates 1.5 of every 2 s
    assert sync["train_s_per_token"] == pytest.approx((2.0 - 1.5 - 0.1) / (4 * (30 + 5)))  # the median row
    actor = summarise_arm([{"rows": rows(2.0, 0.2, [10, 20], **{"async/actor_generate_s": 1.8})}], 0, 4, 5)
    assert actor["engine_idle_frac"] == pytest.approx(0.1)  # the actor's own time, not the trainer's wait
    stream = summarise_arm([{"rows": rows(2.0, 0.2, [10, 20], **{"stream/engine_idle_frac": 0.04})}], 0, 4, 5)
    assert stream["engine_idle_frac"] == pytest.approx(0.04)
    assert summarise_arm([{"error": "exit 2: refused"}], 0, 4, 5) == {"error": "exit 2: refused"}


def test_the_decode_fit_recovers_the_costs_it_was_timed_with_and_requests_are_whole_groups():
    d, a, b, k, p = 0.05, 0.003, 6e-5, 4e-8, 8
    times = [d + a * n + b * c * n + k * c * (p * n + n * n / 2) for c, n in CALIBRATION]
    fit = fit_decode(times, p)
    assert fit["overhead_s"] == pytest.approx(d) and fit["fixed_s"] == pytest.approx(a)
    assert fit["per_seq_s"] == pytest.approx(b) and fit["per_ctx_s"] == pytest.approx(k, rel=1e-6)
    assert [pt["seconds"] for pt in fit["points"]] == times
    assert split(1, 8) == [1] and split(32, 8) == [8] * 4 and split(20, 8) == [8, 8, 4]
