"""A non-finite loss on one rank only (`GRPO_INJECT_FAULT=nonfinite_loss:rank=1:step=2`) on two real gloo processes
(nonfinite_worker.py, one launch for every backend): every rank skips that step together, counts it, and the next
step trains; before ranks agreed on finiteness, rank 1 raised before its backward and rank 0 waited in the gradient
reduction (ddp, fsdp2, ZeRO-2/3) or the gradient norm (megatron's distributed optimizer) until the timeout."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks

WORKER = str(Path(__file__).with_name("nonfinite_worker.py"))
BACKENDS = ["ddp", "fsdp2", "zero2", "zero3", "megatron"]
REPLICATED = {"ddp", "zero2", "megatron"}
"""Backends whose ranks hold the same parameters (megatron here: data parallel 2, no model parallelism)."""


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory) -> list[dict]:
    cases = ",".join([*BACKENDS, "ddp-stop"])
    return run_two_ranks(WORKER, [tiny_checkpoint, cases], tmp_path_factory.mktemp("nonfinite"), timeout=480)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_rank_skips_the_step_together(ranks, backend):
    for rank in ranks:
        steps = rank[backend]["steps"]
        assert [s["skipped"] for s in steps] == [0, 1, 1]
        assert [s["skipped_metric"] for s in steps] == [0.0, 1.0, 1.0]
        assert "loss" in steps[0]["metrics"] and "loss" not in steps[1]["metrics"] and "loss" in steps[2]["metrics"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_skipped_step_changes_nothing_and_the_next_trains(ranks, backend):
    for rank in ranks:
        case = rank[backend]
        first, skipped, after = (s["digest"] for s in case["steps"])
        assert case["initial"] != first and skipped == first and after != skipped
    if backend in REPLICATED:
        assert [s["digest"] for s in ranks[0][backend]["steps"]] == [s["digest"] for s in ranks[1][backend]["steps"]]


def test_on_nonfinite_stop_stops_every_rank_at_the_same_step(ranks):
    for rank in ranks:
        stop = rank["ddp-stop"]
        assert stop["stopped_at"] == 2 and len(stop["steps"]) == 1
        assert "non-finite loss nan on rank 1 at step 2 (1 in a row)" in stop["message"]
