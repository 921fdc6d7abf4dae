"""Weight sync without vLLM: an hf engine holding a separate copy stands in for the rollout engine."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.hf import HFEngine
from grpo_cli.train.weight_sync import buckets, checksum_names, hf_name, sync_weights

PROBE = [[3, 4, 6, 7, 8, 5, 20, 21]]


@pytest.fixture()
def policy(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


def copy_engine(model) -> HFEngine:
    return HFEngine(copy.deepcopy(model).eval(), eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)


def perturb(model, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def test_sync_copies_every_weight_and_reports(policy):
    engine = copy_engine(policy)
    perturb(policy)
    metrics = sync_weights(engine, policy, version=3, bucket_mb=1, verify=True, probe=PROBE)
    for (n, a), (_, b) in zip(policy.named_parameters(), engine.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert engine.weight_version == 3
    size = sum(p.numel() * p.element_size() for p in policy.parameters()) / 2**20
    assert metrics["sync/megabytes"] == pytest.approx(size)
    assert metrics["sync/tensors"] == len(list(policy.parameters()))
    assert metrics["sync/max_probe_diff"] == 0.0 and metrics["sync/seconds"] > 0


def test_lost_sync_is_caught_by_the_probe(policy):
    engine = copy_engine(policy)
    perturb(policy)

    class Lossy(HFEngine):
        def update_weights(self, named_tensors, version):
            list(named_tensors)
            self.weight_version = version

    lossy = Lossy(engine.model, eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)
    with pytest.raises(RolloutError, match=r"version 1 did not take: probe logprobs differ"):
        sync_weights(lossy, policy, version=1, bucket_mb=1, verify=True, probe=PROBE)
    sync_weights(lossy, policy, version=1, bucket_mb=1, verify=False, probe=PROBE)  # verify off: no check


def test_checksum_mismatch_names_the_tensor(policy):
    class StaleReadback(HFEngine):
        def read_weights(self, names):
            return {n: torch.zeros_like(p) for n, p in self.model.named_parameters() if n in names}

    engine = StaleReadback(copy.deepcopy(policy), eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)
    with pytest.raises(RolloutError, match=r"model\.layers\.0\.input_layernorm\.weight differs"):
        sync_weights(engine, policy, version=1, bucket_mb=1, verify=True, probe=None)


def test_version_mismatch_is_caught(policy):
    class Forgetful(HFEngine):
        def update_weights(self, named_tensors, version):
            super().update_weights(named_tensors, version - 1)

    engine = Forgetful(copy.deepcopy(policy), eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)
    with pytest.raises(RolloutError, match="reports weight version 4, expected 5"):
        sync_weights(engine, policy, version=5, bucket_mb=1, verify=True, probe=PROBE)


def test_buckets_respect_the_cap_and_order():
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([100, 100, 300, 50, 10, 1000])]
    groups = list(buckets(params, cap_bytes=1600))
    assert [[n for n, _ in g] for g in groups] == [["p0", "p1"], ["p2", "p3", "p4"], ["p5"]]
    assert all(sum(p.numel() * 4 for _, p in g) <= 1600 or len(g) == 1 for g in groups)


def test_checksum_names_are_spread_1d_weights(policy):
    names = checksum_names(policy, peft=False)
    assert len(names) == 4 and names[0] == "model.layers.0.input_layernorm.weight" and names[-1] == "model.norm.weight"


@pytest.mark.parametrize(("name", "expected"), [
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
    ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("base_model.model.lm_head.original_module.weight", None),
    ("model.norm.weight", "model.norm.weight"),
])
def test_peft_names_map_to_checkpoint_names(name, expected):
    assert hf_name(name, peft=True) == expected


def test_fsdp_and_compile_wrappers_are_stripped():
    assert hf_name("_fsdp_wrapped_module.model._orig_mod.norm.weight", peft=False) == "model.norm.weight"


def test_lora_is_sent_merged_and_the_trained_tensors_stay_bit_exact(policy):
    """A real PEFT model: the engine receives W + (alpha/r)·B·A for every targeted weight, the probe logprobs
    match the adapter's forward, and no trainer tensor is touched (nothing merged in place)."""
    peft = pytest.importorskip("peft")
    engine = copy_engine(policy)
    model = peft.get_peft_model(policy, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = sync_weights(engine, model, version=1, bucket_mb=1, verify=True, probe=PROBE)
    assert metrics["sync/max_probe_diff"] < 1e-4
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    want = q.base_layer.weight + q.lora_B["default"].weight @ q.lora_A["default"].weight * 2.0
    assert torch.allclose(engine.model.model.layers[0].self_attn.q_proj.weight, want, atol=1e-6)
    assert metrics["sync/tensors"] == len(list(engine.model.parameters()))
