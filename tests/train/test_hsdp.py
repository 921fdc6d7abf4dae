"""HSDP (`distributed.fsdp2.replicate`) on 4 real gloo processes, 2 replicas x 2 shard ranks (hsdp_worker.py, one
launch): parity with plain fsdp2 (losses, gradient norms, updated weights and AdamW state after two steps, with an
offload round trip between them; a LoRA adapter), weight-sync gathers inside the shard group, checkpoints that
resume across R in both directions, and the final-model export."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_ranks

WORKER = str(Path(__file__).with_name("hsdp_worker.py"))


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory) -> list[dict]:
    return run_ranks(WORKER, [tiny_checkpoint], tmp_path_factory.mktemp("hsdp"), timeout=300, world=4)


def test_the_mesh_is_two_replicas_of_two_shards(ranks):
    for r in ranks:
        assert r["placements"] == ["R", "S(0)"] and r["mesh"] == [[0, 1], [2, 3]], r
        assert r["local_rows"] == r["rows"] // 2  # sharded over the 2 ranks of a shard group, not over all 4


def test_two_steps_match_plain_fsdp2(ranks):
    """Losses and clipped gradient norms of both steps, then weights and AdamW moments, within 1e-6; the steps moved
    the weights by far more than that (clipping was active: the norms exceed max_grad_norm 0.05 at step 2)."""
    for r in ranks:
        plain, hsdp = r["plain"], r["hsdp"]
        for a, b in zip(plain["steps"], hsdp["steps"], strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6, (a, b)
        assert hsdp["steps"][1]["grad_norm"] > 0.05
        assert r["diff"] <= 1e-6 and hsdp["moved"] > 1e-4, (r["diff"], hsdp["moved"])


def test_lora_adapter_matches_plain_fsdp2(ranks):
    """`init_adapter` and `load_sharded` write each rank's rows of its shard group (a rank's global index would
    read the wrong rows under HSDP)."""
    for r in ranks:
        lora = r["lora"]
        (a,), (b,) = lora["plain"]["steps"], lora["hsdp"]["steps"]
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6, lora
        assert lora["diff"] <= 1e-6, lora
        assert lora["hsdp"]["moved"] > 1e-4, lora


def test_sync_gathers_in_the_shard_group(ranks):
    """One all-gather per bucket, each among the 2 ranks of the shard group (a full copy), the tensors equal to
    `full_tensor()` bit for bit."""
    for r in ranks:
        sync = r["sync"]
        assert sync["identical"] and sync["buckets"] > 1, sync
        assert sync["group_sizes"] == [2] * sync["buckets"], sync


def test_checkpoints_resume_across_replicate(ranks):
    """Written at R=2, loaded at R=1, and the reverse: weights and AdamW state bit for bit (DCP reshards)."""
    for r in ranks:
        for name, mesh in (("2to1", 1), ("1to2", 2)):
            case = r["resume"][name]
            assert case["diff"] == 0.0 and case["reader_mesh"] == mesh and case["steps"] == [2], (name, case)


def test_export_consolidates_the_replicated_shards(ranks):
    export = ranks[0]["export"]
    assert export["tensors"] > 0 and export["identical"] and not export["missing"], export
