"""Data-parallel and sharded correctness: a 2-process gloo run (torchrun) on the same replayed global batch and seed
ends with the same parameters as the 1-process DDP run (token_mean counts tokens across ranks; each backend's
gradient scaling is right), and the sharded backends hold only their share of the parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dp_harness import SHARDED, run_worker
from safetensors.torch import load_file

@pytest.fixture(scope="module")
def one_process(tiny_checkpoint, tmp_path_factory):
    """The 1-process DDP reference, per aggregation."""
    tmp = tmp_path_factory.mktemp("one")
    return {agg: run_worker(tiny_checkpoint, tmp / f"{agg}.safetensors", agg, procs=1)
            for agg in ("token_mean", "seq_mean_token_mean")}


@pytest.mark.slow
@pytest.mark.parametrize("aggregation,backend", [
    ("token_mean", []), ("seq_mean_token_mean", []), ("token_mean", SHARDED),
])
def test_two_processes_equal_one_process(tmp_path, tiny_checkpoint, one_process, aggregation, backend):
    out = tmp_path / "two.safetensors"
    a, b = one_process[aggregation], run_worker(tiny_checkpoint, out, aggregation, *backend, procs=2)
    initial = load_file(Path(tiny_checkpoint) / "model.safetensors")
    moved = max(float((a[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3, "the steps must actually change the weights"
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-5, f"2-process params differ from 1-process by {worst}"
    numel = json.loads(out.with_suffix(".json").read_text())
    share = numel["local"] / numel["total"]
    assert share <= 0.55 if backend else share == 1.0, numel
