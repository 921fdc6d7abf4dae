"""Weight sync with an engine that takes pushes from rank 0 only (server mode, SGLang, async): two real gloo
processes (sync_ranks_worker.py) and fake engines that count each rank's calls."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks

from grpo_cli.runtime.dist import DistInfo
from grpo_cli.rollout.base import RolloutEngine, RolloutError
from grpo_cli.rollout.transport.http_client import RolloutServerDown
from grpo_cli.train.weights.sync_ranks import generate_with_resync, pushes_from_main

WORKER = str(Path(__file__).with_name("sync_ranks_worker.py"))


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory) -> list[dict]:
    return run_two_ranks(WORKER, [tiny_checkpoint], tmp_path_factory.mktemp("sync-ranks"), timeout=180)


def test_rank_0_alone_pushes_and_asks_the_engine(ranks):
    zero, one = ranks[0]["plain"], ranks[1]["plain"]
    assert zero["calls"] == {"update_weights": 1, "score": 1, "read_weights": 1}
    assert one["calls"] == {"update_weights": 0, "score": 0, "read_weights": 0}
    assert zero["version"] == one["version"] == 3  # rank 1 records what the servers now hold
    assert one["forwards"] == zero["forwards"] == 1  # the probe's trainer forward runs on every rank (collective)
    assert zero["metrics"] == one["metrics"]  # rank 0's figures on both: mean_metrics needs the same keys
    assert one["metrics"]["sync/max_probe_diff"] < 1e-5 and one["metrics"]["sync/checked_tensors"] > 0


def test_other_ranks_follow_update_when_the_engine_has_it(ranks):
    assert ranks[0]["follow"]["followed"] == [] and ranks[1]["follow"]["followed"] == [4]
    assert ranks[1]["follow"]["calls"]["update_weights"] == 0


def test_a_push_failing_on_rank_0_fails_every_rank_alike(ranks):
    zero, one = ranks[0]["push_fails"], ranks[1]["push_fails"]
    assert zero["type"] == one["type"] == "RolloutServerDown"
    assert zero["recovered"] is one["recovered"] is False  # so every rank saves the checkpoint together
    assert one["message"] == "rank 0: " + zero["message"]


def test_a_verification_failing_on_rank_0_fails_every_rank(ranks):
    zero, one = ranks[0]["verify_fails"], ranks[1]["verify_fails"]
    assert "version 6 did not take" in zero["message"] and one["message"] == "rank 0: " + zero["message"]


def test_a_server_lost_by_one_rank_resyncs_every_rank(ranks):
    for rank, res in enumerate(ranks):
        assert res["resync"]["syncs"] == [7] and res["resync"]["rollout"] == f"rollout of rank {rank}"
    assert [r["resync"]["generated"] for r in ranks] == [1, 2]  # only the rank that lost its answer retries


def test_a_deferred_probe_reports_one_sync_late_and_fails_every_rank_when_settled(ranks):
    """Stream mode: rank 0 runs the probe in the background; the next sync (or a checkpoint's settle) returns its
    figures on every rank, and a probe that fails raises on every rank then, not at the sync that started it."""
    zero, one = ranks[0]["deferred"], ranks[1]["deferred"]
    for key in ("first", "second", "settled", "lossy_sync", "lossy_settle", "after", "next_sync"):
        assert (zero[key] or {}).keys() == (one[key] or {}).keys(), key  # same keys: mean_metrics
    assert zero["first"]["sync/probe_deferred"] == 1.0 and "sync/max_probe_diff" not in zero["first"]
    assert one["second"]["sync/max_probe_diff"] == zero["second"]["sync/max_probe_diff"] < 1e-5  # v8's, via rank 0
    assert one["settled"]["sync/max_probe_diff"] == zero["settled"]["sync/max_probe_diff"] < 1e-5  # v9's
    assert zero["calls"]["score"] == 2 and one["calls"]["score"] == 0
    assert zero["lossy_sync"]["sync/probe_deferred"] == 1.0  # the sync itself passed: its probe had not run
    assert "probe logprobs differ" in zero["lossy_settle"]["message"]
    assert one["lossy_settle"]["message"] == "rank 0: " + zero["lossy_settle"]["message"]
    assert zero["after"] == one["after"] == {}  # settled once: nothing left
    next_zero, next_one = zero["next_sync"], one["next_sync"]  # the next sync settles first: it fails alike
    assert "probe logprobs differ" in next_zero["message"] and next_one["message"] == "rank 0: " + next_zero["message"]


class _Engine(RolloutEngine):
    push_from_main_only = True
    weight_version = 2


def test_single_process_keeps_the_old_paths():
    """One process: nothing collective; a lost server is re-synced and retried, any other error raised."""
    info = DistInfo()
    assert not pushes_from_main(_Engine(), info) and pushes_from_main(_Engine(), DistInfo(0, 2, 0))
    syncs, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RolloutServerDown("back", url="u", recovered=True)
        return "ok"

    assert generate_with_resync(_Engine(), syncs.append, info, flaky) == "ok" and syncs == [2]

    def broken():
        raise RolloutError("bad request")

    with pytest.raises(RolloutError, match="bad request"):
        generate_with_resync(_Engine(), syncs.append, info, broken)
