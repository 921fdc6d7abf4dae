"""fsdp2 on two real gloo processes (fsdp2_worker.py, one launch for every case): gradient memory under
accumulation, FSDP2's own policies (CPU offload, reduce dtype), `distributed.offload` of DTensor state through the
pinned-copy branch, and weight-sync gathers bounded by `weight_sync_bucket_mb`."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks

WORKER = str(Path(__file__).with_name("fsdp2_worker.py"))


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint, tmp_path_factory) -> list[dict]:
    return run_two_ranks(WORKER, [tiny_checkpoint], tmp_path_factory.mktemp("fsdp2"), timeout=240)


def test_default_accumulation_keeps_only_the_gradient_shard(ranks):
    """4 micro-batches: by default every micro-batch is reduce-scattered, so between micro-batches a rank holds its
    shard (half of the model's fp32 gradients on 2 ranks); with unsharded_grad_accumulation the whole model's."""
    for r in ranks:
        default, unsharded = r["default"], r["unsharded"]
        assert default["shard_bytes"] <= 0.55 * default["full_bytes"]
        assert default["held"] == [default["shard_bytes"]] * 4, default
        assert unsharded["held"][:3] == [unsharded["full_bytes"]] * 3, unsharded
        assert unsharded["held"][3] == unsharded["shard_bytes"]  # reduce-scattered at the step's last micro-batch


def test_both_accumulations_give_the_same_update(ranks):
    """Sum-then-reduce vs reduce-then-sum: the same step up to float32 rounding (lr 1e-2 moves weights ~1e-2)."""
    assert all(r["update_diff"] <= 1e-5 for r in ranks), [r["update_diff"] for r in ranks]


def test_abandoned_unsharded_accumulation_leaves_nothing_behind(ranks):
    """`zero_grad` after a micro-batch without sync also drops FSDP2's unsharded gradients (the next step used to
    add them)."""
    assert all(r["abandoned_diff"] == 0.0 for r in ranks)


def test_cpu_offload_applies_fsdp2_policy_and_trains_alike(ranks):
    for r in ranks:
        off = r["cpu_offload"]
        assert off["offload_policy"] == ["CPUOffloadPolicy"] and off["offload_to_cpu"] == [True], off
        assert off["update_diff"] <= 1e-6, off
        assert r["bf16_reduce"]["offload_policy"] == ["OffloadPolicy"]


def test_reduce_dtype_reaches_the_mixed_precision_policy(ranks):
    assert all(r["bf16_reduce"]["reduce_dtype"] == ["torch.bfloat16"] for r in ranks)
    assert all(r["cpu_offload"]["reduce_dtype"] == ["torch.float32"] for r in ranks)  # the default


def test_dtensor_offload_round_trip_through_the_pinned_branch(ranks):
    """Gradients, AdamW state (DTensors) and parameters go to the host and back with the pinned-copy branch taken:
    only plain local shards reach `host_copy` (a DTensor there fails: "aten.copy_.default got mixed torch.Tensor
    and DTensor"), every shard comes back bit-identical, and the next step equals a twin that never moved."""
    for r in ranks:
        off = r["offload"]
        assert "error" not in off, off.get("error")
        assert off["copies"]["plain"] > 0 and off["copies"]["dtensor"] == 0, off["copies"]
        assert off["state_moved"] and off["grads_parked"] and off["same_keys"] and off["bit_identical"], off
        assert off["identity"] and off["optimizer_refs"], off
        assert off["second_step_diff"] == 0.0, off


def test_sync_gathers_follow_the_bucket_cap(ranks):
    """One all-gather per bucket (not one `full_tensor` per parameter), no gather larger than the cap unless one
    tensor is, and the tensors equal `full_tensor()` bit for bit, uneven row splits included."""
    for r in ranks:
        sync = r["sync"]
        assert sync["uneven"]
        counts = []
        for cap_mb, case in sync["caps"].items():
            cap = float(cap_mb) * 2**20
            assert case["identical"], (cap_mb, case)
            assert case["full_tensor"] == 0 and case["all_gather"] == case["buckets"], (cap_mb, case)
            assert case["largest"] <= max(cap, case["largest_tensor"]), (cap_mb, case)
            counts.append(case["all_gather"])
        assert counts[0] == 1 < counts[1] < counts[2] < sync["tensors"], counts  # caps 1, 0.05, 0.01 MB


def test_no_grad_passes_leave_every_parameter_sharded(ranks):
    """FSDP2 keeps a root unit's parameters unsharded after its forward (for the backward that follows in training).
    The KL reference never runs a backward: its embedding, final norm and output layer would stay whole on every
    rank for the rest of the run (at Qwen2.5-7B's 152K × 3,584, two such matrices are 2.2 GB in bf16). The backend
    reshards the models a no-grad pass ran, so nothing is left whole after it."""
    for r in ranks:
        got = r["no_grad"]
        assert got["before"] == [] and got["after_step"] == [], got
        assert got["reference"] == [] and got["policy"] == [], got
