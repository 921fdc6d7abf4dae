"""Weight sync without vLLM: an hf engine holding a separate copy stands in for the rollout engine."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.hf.engine import HFEngine
from grpo_cli.train.weights.hf_module import buckets, checkpoint_names, checksum_names, describe_ties, hf_name
from grpo_cli.train.weights.weight_sync import sync_weights

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
    with pytest.raises(RolloutError, match=r"version 1 did not take: probe logprobs differ") as caught:
        sync_weights(lossy, policy, version=1, bucket_mb=1, verify=True, probe=PROBE)
    text = str(caught.value)
    assert "Checked: the weight version the engine reports; the logprobs of 7 probe tokens" in text
    assert "cannot read its weights back" in text  # so it cannot name the tensors
    assert "Only as a last resort: `rollout.vllm.verify_sync: false`" in text and "goes unnoticed" in text
    assert "server mode" not in text
    lossy.urls = ["http://127.0.0.1:1"]  # a server client: the same key, said to govern server mode too
    with pytest.raises(RolloutError, match=r"also governs the check in server mode.*the server's --model|"
                                            r"the server's --model.*also governs the check in server mode"):
        sync_weights(lossy, policy, version=1, bucket_mb=1, verify=True, probe=PROBE)
    sync_weights(lossy, policy, version=1, bucket_mb=1, verify=False, probe=PROBE)  # verify off: no check


def test_checksum_mismatch_names_the_tensor(policy):
    class StaleReadback(HFEngine):
        def read_weights(self, names):
            return {n: torch.zeros_like(p) for n, p in self.model.named_parameters() if n in names}

    engine = StaleReadback(copy.deepcopy(policy), eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)
    with pytest.raises(RolloutError, match=r"model\.layers\.0\.input_layernorm\.weight differs"):
        sync_weights(engine, policy, version=1, bucket_mb=1, verify=True, probe=None)


@pytest.fixture(scope="module")
def tied_policy(tmp_path_factory):
    """A tiny Qwen2 with tied embeddings (`lm_head.weight` is `model.embed_tokens.weight`)."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), arch="qwen2")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_tied_weight_is_sent_under_every_checkpoint_name(tied_policy, policy):
    names = checkpoint_names(tied_policy, peft=False)
    assert names["model.embed_tokens.weight"] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert "lm_head.weight" not in dict(tied_policy.named_parameters())  # listed once, under the embedding
    assert "also as lm_head.weight" in describe_ties(tied_policy)
    assert describe_ties(policy) is None and all(len(v) == 1 for v in checkpoint_names(policy, peft=False).values())

    received: list[str] = []

    class Recording(HFEngine):
        def update_weights(self, named_tensors, version):
            super().update_weights(((received.append(n) or (n, t)) for n, t in named_tensors), version)

    engine = Recording(copy.deepcopy(tied_policy), eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)
    perturb(tied_policy)
    metrics = sync_weights(engine, tied_policy, version=1, bucket_mb=1, verify=True, probe=PROBE)
    assert received.count("lm_head.weight") == 1 and received.count("model.embed_tokens.weight") == 1
    assert metrics["sync/tensors"] == len(list(tied_policy.parameters())) + 1 == len(received)
    assert metrics["sync/max_probe_diff"] == 0.0
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # the copy stays tied


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


def test_lora_merged_sync_of_a_tied_model_sends_the_tied_name(tied_policy):
    peft = pytest.importorskip("peft")
    engine = copy_engine(tied_policy)
    lora = peft.get_peft_model(copy.deepcopy(tied_policy),
                               peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    names = checkpoint_names(lora, peft=True)
    assert names["base_model.model.model.embed_tokens.weight"] == ["model.embed_tokens.weight", "lm_head.weight"]
    metrics = sync_weights(engine, lora, version=1, bucket_mb=1, verify=True, probe=PROBE)
    assert metrics["sync/tensors"] == len(list(tied_policy.parameters())) + 1 and metrics["sync/max_probe_diff"] < 1e-5


def test_an_engine_that_scores_nan_everywhere_is_refused(policy):
    """The probe skips the positions an engine answers NaN (SGLang's image placeholders); NaN at every position is
    an engine whose weights compute NaN. Before the skip, a NaN mean compared False with the tolerance: it passed."""
    class Poisoned(HFEngine):
        def update_weights(self, named_tensors, version):
            super().update_weights(((n, torch.full_like(t, float("nan"))) for n, t in named_tensors), version)

    engine = Poisoned(copy.deepcopy(policy).eval(), eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)
    with pytest.raises(RolloutError, match="probe logprobs are all NaN"):
        sync_weights(engine, policy, version=1, bucket_mb=1, verify=True, probe=PROBE)
