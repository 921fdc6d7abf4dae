"""The rank-divergence suite (DESIGN.md 4c, docs/distributed.md "Rank agreement"): 2 gloo processes with a 1-minute
collective timeout, each rank fed different conditions (divergence_worker.py, one launch): an empty micro-batch, all
rows truncated under mask_truncated_completions, different token-budget micro-batch counts, on ddp, fsdp2, HSDP
(`fsdp2.replicate=2`), ZeRO-2/3 and megatron; metric keys on one rank only, dynamic sampling drawing different
rounds, a stop signal on one rank, `checkpoint.resume: auto` finding a checkpoint on one rank's disk only, a served
teacher refusing one rank's request. Every case ends with both ranks at the same point, having run the same
collectives."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks

WORKER = str(Path(__file__).with_name("divergence_worker.py"))
BACKENDS = ["ddp", "fsdp2", "hsdp", "zero2", "zero3", "megatron"]


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, short_teacher, tmp_path_factory) -> list[dict]:
    return run_two_ranks(WORKER, [tiny_checkpoint, short_teacher, ",".join(BACKENDS)],
                         tmp_path_factory.mktemp("ranks"), timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_or_truncated_rank_steps_with_its_peer(ranks, backend):
    for case in ("masked", "truncated"):
        zero, one = ranks[0][backend][case], ranks[1][backend][case]
        assert zero["finite"] and one["finite"], (case, zero, one)
        assert zero["micro_batches"] == one["micro_batches"] and zero["keys"] == one["keys"]
        assert one["loss"] == 0.0 and zero["loss"] != 0.0  # rank 1 trains on nothing; rank 0's rows count


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "megatron"])
def test_token_budgets_run_the_same_micro_batch_count(ranks, backend):
    for case in ("budget", "budget_masked"):
        zero, one = ranks[0][backend][case], ranks[1][backend][case]
        assert zero["micro_batches"] == one["micro_batches"] > 1, (case, zero, one)
        assert zero["finite"] and one["finite"] and zero["keys"] == one["keys"]


def test_metric_keys_of_one_rank_are_reduced_over_the_ranks_that_have_them(ranks):
    zero, one = ranks[0]["once"]["metrics"], ranks[1]["once"]["metrics"]
    assert zero == one == {"loss": 2.0, "reward/mean": 2.0, "memory/peak_rss_mb": 20.0,
                           "tools/calls_per_rollout": 1.5}


def test_dynamic_sampling_draws_the_same_rounds_on_every_rank(ranks):
    zero, one = ranks[0]["once"]["dynamic"], ranks[1]["once"]["dynamic"]
    assert zero["drawn"] == one["drawn"] == [1, 2]  # rank 0 was full at once, yet draws with rank 1
    assert zero["groups"] == one["groups"] == 3 and zero["rows"] == one["rows"] == 6
    assert zero["metrics"] == one["metrics"] and zero["metrics"]["dynamic_sampling/short_groups"] == 0.0


def test_a_stop_signal_on_one_rank_stops_every_rank_at_the_same_step(ranks):
    zero, one = ranks[0]["once"]["stop"], ranks[1]["once"]["stop"]
    assert zero["steps"] == one["steps"] == 1 and zero["collectives"] == one["collectives"] == [2.0]
    assert zero["stopped"] is one["stopped"] is True  # neither rank goes on to export the final model alone
    assert zero["settled"] == [zero["steps"]] and one["settled"] == []  # after the loop, on rank 0, both ranks there


def test_a_teacher_failing_for_one_rank_fails_every_rank(ranks):
    zero, one = ranks[0]["once"]["teacher"], ranks[1]["once"]["teacher"]
    assert one["raised"] == "RolloutError" and "max_model_len" in one["message"]
    assert zero["raised"] == "RolloutError" and "rank 1" in zero["message"], zero


def test_resume_auto_fails_alike_when_the_ranks_see_different_checkpoints(ranks):
    zero, one = ranks[0]["once"]["resume"], ranks[1]["once"]["resume"]
    assert zero["raised"] == one["raised"] == "CheckpointError", (zero, one)
    assert "rank 0: none, rank 1:" in zero["message"] and zero["message"] == one["message"]
