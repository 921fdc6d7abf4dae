"""The invariants of benchmarks/pipeline_sim.py's discrete-event simulator (sync, one-step async, stream), each
against a figure computed here by hand: pure Python, milliseconds."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks` is not installed

from benchmarks.pipeline_sim import Hardware, Workload, simulate  # noqa: E402
from benchmarks.sim_core import Groups, after_warmup  # noqa: E402

HW = Hardware(rollout_engines=1, train_gpus=1, decode_fixed_s=0.005, decode_per_seq_s=0.0002,
              train_s_per_token=2e-5, sync_s=0.05)
W = Workload(steps=8, prompts_per_step=4, generations=4, prompt_len=10,
             lengths={"kind": "geometric", "mean": 40, "max": 300}, max_in_flight=8, max_version_lag=1)


def generation_seconds(hw: Hardware, lengths: list[int], prompt_len: int) -> float:
    """One engine decoding `lengths` together from the same start: between two endings the concurrency c is fixed
    and a decode step at token x costs step_s(c) + decode_per_ctx_s * c * (prompt_len + x), integrated over x."""
    total, done, c = 0.0, 0, len(lengths)
    for n in sorted(lengths):
        total += (n - done) * (hw.step_s(c) + hw.decode_per_ctx_s * c * prompt_len)
        total += hw.decode_per_ctx_s * c * (n * n - done * done) / 2
        done, c = n, c - 1
    return total


def test_sync_with_nothing_but_generation_takes_the_generation_time():
    """Decode (its step growing with the contexts) plus one prefill per group (its samples share the prompt)."""
    hw = replace(HW, train_s_per_token=0.0, sync_s=0.0, prefill_s_per_token=1e-4, decode_per_ctx_s=1e-6)
    r = simulate(hw, W, ["sync"])["sync"]
    groups = Groups(W)
    per_step = [[n for g in range(s * 4, s * 4 + 4) for n in groups[g]] for s in range(W.steps)]
    prefill = W.steps * W.prompts_per_step * W.prompt_len * 1e-4
    assert r["seconds"] == pytest.approx(sum(generation_seconds(hw, n, W.prompt_len) for n in per_step) + prefill, rel=1e-9)
    assert r["trained_completion_tokens"] == r["generated_tokens"] == sum(map(sum, per_step))
    assert r["engine_idle_frac"] == pytest.approx(0.0, abs=1e-9)
    assert r["version_lag_max"] == 0


def test_sync_adds_train_and_sync_time_and_engines_split_the_batch():
    fixed = replace(W, lengths={"kind": "fixed", "value": 50})
    one = simulate(replace(HW, decode_per_seq_s=0.0), fixed, ["sync"])["sync"]
    tokens = 4 * 4 * (50 + 10)
    assert one["step_s_median"] == pytest.approx(50 * 0.005 + tokens * 2e-5 + 0.05)
    two = simulate(replace(HW, decode_per_seq_s=0.0, rollout_engines=2), fixed, ["sync"])["sync"]
    assert two["step_s_median"] == pytest.approx(one["step_s_median"])  # the step time is set by decode steps
    assert two["tokens_per_s_per_gpu"] == pytest.approx(two["tokens_per_s"] / 3)


def test_rates_after_the_warmup_leave_out_the_first_steps_as_a_benchmark_does():
    """`after_warmup`: tokens/s and step times over the steps after `skip` (the per-step tokens and seconds add up to
    the run's); the first step of a stream run fills the pool, so leaving it out raises the rate."""
    r = simulate(HW, W, ["stream"])["stream"]
    assert len(r["step_seconds"]) == len(r["step_tokens"]) == W.steps
    assert sum(r["step_tokens"]) == r["trained_completion_tokens"]
    assert sum(r["step_seconds"]) == pytest.approx(r["seconds"])
    assert after_warmup(r, 0)["tokens_per_s"] == pytest.approx(r["tokens_per_s"])
    late = after_warmup(r, 2)
    assert late["tokens_per_s"] == pytest.approx(sum(r["step_tokens"][2:]) / sum(r["step_seconds"][2:]))
    assert late["step_s_mean"] == pytest.approx(sum(r["step_seconds"][2:]) / (W.steps - 2))
    assert late["tokens_per_s"] > r["tokens_per_s"]
    assert after_warmup(r, W.steps)["tokens_per_s"] == pytest.approx(r["tokens_per_s"])  # nothing left: all steps


def test_async_overlaps_generation_with_training_at_lag_one():
    """Fixed lengths, generation 0.25 s = training 0.25 s a step, no sync: sync takes 0.5 s a step, async 0.25."""
    fixed = replace(W, lengths={"kind": "fixed", "value": 50}, steps=10)
    hw = replace(HW, decode_per_seq_s=0.0, sync_s=0.0, train_s_per_token=0.25 / (4 * 4 * 60))
    r = simulate(hw, fixed, ["sync", "async"])
    assert r["sync"]["step_s_median"] == pytest.approx(0.5)
    assert r["async"]["step_s_median"] == pytest.approx(0.25)
    assert r["async"]["version_lag_max"] == 1  # batch k sampled with the weights of step k-1
    assert r["async"]["trained_completion_tokens"] == r["sync"]["trained_completion_tokens"]


def test_stream_idles_the_engine_only_while_paused_for_a_sync():
    """The buffer always has room: the engine decodes at every moment but the pauses (steps x sync_s)."""
    w = replace(W, max_buffered=10_000, max_version_lag=3)
    r = simulate(HW, w, ["stream"])["stream"]
    assert r["engine_idle_frac"] * r["seconds"] == pytest.approx(w.steps * HW.sync_s, rel=1e-6)
    r0 = simulate(replace(HW, sync_s=0.0), w, ["stream"])["stream"]
    assert r0["engine_idle_frac"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_stream_keeps_the_pool_full_and_the_lag_bound(lag):
    w = replace(W, max_version_lag=lag, steps=12)
    r = simulate(HW, w, ["stream"])["stream"]
    # reached, never exceeded: the lag bound admits prompts_per_step × (lag + 1) groups (8 at lag 1 and 2)
    assert r["peak_in_flight"] == min(w.max_in_flight, w.prompts_per_step * (lag + 1))
    assert r["version_lag_max"] <= lag
    assert r["generated_tokens"] >= r["trained_completion_tokens"]
    if lag == 0:  # nothing starts while a step trains (it could only train one version late): sync's schedule
        assert r["dropped_groups"] == 0 and r["generated_tokens"] == r["trained_completion_tokens"]


def test_stream_beats_sync_on_a_heavy_tail_and_runs_are_deterministic():
    w = replace(W, lengths={"kind": "lognormal", "median": 30, "sigma": 1.0, "max": 400}, steps=12,
                max_version_lag=2)
    a, b = simulate(HW, w), simulate(HW, w)
    assert a == b
    assert a["stream"]["tokens_per_s"] > a["sync"]["tokens_per_s"]
    assert simulate(HW, replace(w, seed=1), ["sync"])["sync"] != a["sync"]


def test_async_is_at_most_stream_is_at_most_the_bound_on_a_heavy_tail():
    """Bounds, by hand: the trainer trains then syncs in series (seconds >= train busy + steps x sync_s), and an
    engine decodes at most C / step_s(C) tokens/s with C the pool's largest concurrency."""
    w = replace(W, lengths={"kind": "lognormal", "median": 30, "sigma": 1.0, "max": 400}, steps=12,
                max_version_lag=2, max_in_flight=8)
    r = simulate(HW, w, ["async", "stream"])
    s = r["stream"]
    train_bound = s["trained_completion_tokens"] / ((1 - s["trainer_idle_frac"]) * s["seconds"] + w.steps * HW.sync_s)
    c = w.max_in_flight * w.generations
    generation_bound = HW.rollout_engines * c / HW.step_s(c)
    assert r["async"]["tokens_per_s"] < s["tokens_per_s"] <= min(train_bound, generation_bound)


def test_identical_lengths_make_stream_match_async_with_a_one_step_pool():
    """No tail to hide: a pool of one step's groups at lag 1 is async's schedule, up to the sync pauses' timing."""
    fixed = replace(W, lengths={"kind": "fixed", "value": 50}, steps=12, max_version_lag=1, max_in_flight=4)
    r = simulate(HW, fixed, ["async", "stream"])
    assert r["stream"]["tokens_per_s"] == pytest.approx(r["async"]["tokens_per_s"], rel=0.03)
    assert r["stream"]["step_s_median"] == pytest.approx(r["async"]["step_s_median"], rel=0.03)


def test_cli_overlays_flags_on_the_inputs_file_and_writes_the_results(tmp_path, monkeypatch, capsys):
    from benchmarks import pipeline_sim
    spec = tmp_path / "in.json"
    spec.write_text('{"workload": {"steps": 3, "lengths": {"kind": "fixed", "value": 20}}}')
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["pipeline_sim", str(spec), "--set", "hardware.sync_s=0.5", "--out", str(out)])
    pipeline_sim.main()
    import json
    got = json.loads(out.read_text())
    assert got["hardware"]["sync_s"] == 0.5 and got["workload"]["steps"] == 3
    assert set(got["results"]) == {"sync", "async", "stream"}
    assert "stream" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["pipeline_sim", "--set", "hardware.sync_s"])
    with pytest.raises(SystemExit) as e:
        pipeline_sim.main()
    assert e.value.code == 2
