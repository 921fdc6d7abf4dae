"""LoRA policies (PEFT) through the backend seam: only the adapter trains, the reference is the adapter disabled,
checkpoints restore it exactly, and the exports load with PEFT / as a plain model."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.config.load import build_config
from grpo_cli.models.logprobs import score_sequences
from grpo_cli.train.policy import load_policy

peft = pytest.importorskip("peft")
SEQ = [[6, 30, 40, 41, 9, 12, 13, 14]]


def _policy(tiny_checkpoint, *sets):
    cfg = build_config("tiny-cpu-lora", overrides=[f"model.name_or_path={tiny_checkpoint}", *sets])
    return cfg, load_policy(cfg, tiny_checkpoint, device=torch.device("cpu"))


def _step(policy) -> None:
    """One AdamW step on a loss that moves every trained parameter."""
    backend = policy.backend
    backend.zero_grad()
    ids = torch.tensor(SEQ)
    loss = policy.model(input_ids=ids, labels=ids).loss
    backend.backward(loss)
    backend.clip_and_step()


def test_only_the_adapter_and_modules_to_save_train(tiny_checkpoint):
    cfg, policy = _policy(tiny_checkpoint, "algorithm.kl.beta=0.04")
    trained = {n: p for n, p in policy.module.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or "modules_to_save" in n for n in trained)
    lora = sum(p.numel() for n, p in trained.items() if "lora_" in n)
    # 2 layers × 7 linear layers, each r·(in + out); hidden 64, MLP 128, r 16.
    per_layer = 16 * ((64 + 64) * 4 + (64 + 128) * 3)
    assert lora == 2 * per_layer
    in_optimizer = sum(p.numel() for g in policy.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for p in trained.values())
    frozen = {n: p.detach().clone() for n, p in policy.module.named_parameters() if not p.requires_grad}
    _step(policy)
    assert all(torch.equal(p, frozen[n]) for n, p in policy.module.named_parameters() if not p.requires_grad)
    assert policy.ref_model is None  # no second copy: the reference is the adapter disabled


def test_reference_is_the_base_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    _, policy = _policy(tiny_checkpoint, "algorithm.kl.beta=0.04")
    _step(policy)
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    with policy.backend.reference() as ref:
        ref_lp = score_sequences(ref, SEQ, pad_token_id=0)
    policy_lp = score_sequences(policy.module, SEQ, pad_token_id=0)
    base_lp = score_sequences(base, SEQ, pad_token_id=0)
    assert max(abs(a - b) for a, b in zip(ref_lp[0], base_lp[0])) < 1e-5
    assert max(abs(a - b) for a, b in zip(policy_lp[0], base_lp[0])) > 1e-3  # the adapter is back on after


def test_checkpoint_restores_the_adapter_exactly(tiny_checkpoint, tmp_path):
    """Adapter + optimizer state from `save_state` (scheduler and RNG are checkpoint.py's): the next step of the
    restored policy equals the next step of the original, bit for bit."""
    _, policy = _policy(tiny_checkpoint)
    _step(policy)
    policy.backend.save_state(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists() and not (tmp_path / "model.safetensors").exists()
    schedule = policy.scheduler.state_dict()
    _step(policy)
    _, fresh = _policy(tiny_checkpoint)
    fresh.backend.load_state(tmp_path)
    fresh.scheduler.load_state_dict(schedule)
    _step(fresh)
    want = dict(policy.module.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in fresh.module.named_parameters())


def test_exports_load_as_adapter_and_as_merged_model(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    _, policy = _policy(tiny_checkpoint)
    _step(policy)
    policy.backend.export_adapter(tmp_path / "adapter")
    policy.backend.export_merged(tmp_path / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    policy.module.eval()
    want = score_sequences(policy.module, SEQ, pad_token_id=0)[0]
    for model in (loaded, merged):
        got = score_sequences(model, SEQ, pad_token_id=0)[0]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
