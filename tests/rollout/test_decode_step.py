"""The lean one-token decode forward (`rollout.decode_step`) computes what transformers' forward computes: on Llama,
Qwen2 (q/k/v biases, tied embeddings, GQA) and Qwen3 (q/k norms) checkpoints, with left-padded prompts and rows
dropped mid-decode, the hf engine samples the same tokens with the same logprobs through it as through the model's
forward, and those equal the trainer's recompute. Architectures it does not reproduce keep the full forward."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.rollout.hf import decode_step
from grpo_cli.models.attention import attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf.decode import decode
from grpo_cli.models.logprobs import completion_logprobs
from grpo_cli.train.batch import build_batch

PROMPTS = [[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]]


def load(tmp_path_factory, arch: str, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp(arch) / "ckpt", hidden_size=128, arch=arch)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_implementation(attn)).eval()


def run(model, monkeypatch, *, lean: bool, eos: int):
    calls = []
    real = decode_step.decode_sample

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_mod, "decode_sample", counted)
    monkeypatch.setattr(decode_mod, "decoder_parts", decode_step.decoder_parts if lean else (lambda m: None))
    out = decode(model, PROMPTS, SamplingParams(n=4, max_tokens=12, temperature=0.9, seed=7), eos_token_ids=[eos],
                 pad_token_id=0)
    return out, len(calls)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_lean_step_samples_what_the_full_forward_samples(tmp_path_factory, monkeypatch, arch):
    model = load(tmp_path_factory, arch)
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", 0.0)  # drop every finished row at once
    eos = 6 if arch == "llama" else 1
    lean, lean_calls = run(model, monkeypatch, lean=True, eos=eos)
    full, full_calls = run(model, monkeypatch, lean=False, eos=eos)
    assert lean_calls > 0 and full_calls == 0
    assert 0 < int(lean.stopped.sum()) < len(lean.stopped)  # some rows dropped mid-decode, some ran to the end
    assert torch.equal(lean.lengths, full.lengths) and torch.equal(lean.tokens, full.tokens)
    assert torch.allclose(lean.logprobs, full.logprobs, atol=1e-5)
    # the sampled rows are the trainer's too: its recompute of every sampled token's logprob matches
    n = lean.lengths.tolist()
    from grpo_cli.rollout.base import RolloutBatch

    batch = RolloutBatch(prompt_ids=PROMPTS, completion_ids=[r[:k] for r, k in zip(lean.tokens.tolist(), n)],
                         finish_reasons=["stop"] * len(n), sampler_logprobs=[r[:k] for r, k in
                                                                              zip(lean.logprobs.tolist(), n)],
                         weight_version=0, timings={})
    tb = build_batch(batch, group_size=4, pad_token_id=0)
    with torch.no_grad():
        lp = completion_logprobs(model, tb.input_ids, tb.attention_mask, logits_to_keep=tb.num_completion_tokens,
                                 temperature=0.9)
    assert torch.allclose(lp * tb.completion_mask, tb.sampler_logprobs, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_lean_step_logits_equal_the_forward_over_the_whole_sequence(tmp_path_factory, arch):
    """Independent of the decode loop: prefill, then feed tokens one by one through `decode_logits` and compare
    each step's logits with a full forward over prompt + tokens so far (left padding included). The plain
    projections run fused (q/k/v, gate/up: one matmul each)."""
    model = load(tmp_path_factory, arch, attn="eager")
    parts = decode_step.decoder_parts(model)
    assert parts is not None
    cache, _, rows, width = decode_mod._prefill(model, PROMPTS, 1, 5, 0)
    plan = decode_step.plan_decode(parts, max_positions=width + 5)
    assert all(layer.qkv is not None and layer.gate_up is not None for layer in plan.layers)
    fed = torch.tensor([[30, 31, 32, 33]] * len(PROMPTS))
    ids, mask = decode_mod.left_pad(PROMPTS, 0)
    bias = decode_mod.step_bias(rows.mask, width)
    keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    with torch.no_grad():
        for t in range(fed.shape[1]):
            bias[..., width + t] = 0.0
            lean = decode_step.decode_logits(plan, keys, values, fed[:, t], rows.next_pos,
                                             width + t, bias)
            rows.next_pos += 1
            full_ids = torch.cat([ids, fed[:, : t + 1]], 1)
            full_mask = torch.cat([mask, torch.ones_like(fed[:, : t + 1])], 1)
            pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
            ref = model(input_ids=full_ids, attention_mask=full_mask, position_ids=pos).logits[:, -1]
            assert torch.allclose(lean, ref, atol=1e-5), (t, (lean - ref).abs().max())


def test_other_architectures_keep_the_full_forward(tmp_path_factory):
    assert decode_step.decoder_parts(load(tmp_path_factory, "gemma")) is None  # embedding scale, (1 + w) norms
    model = load(tmp_path_factory, "qwen2")
    model.config.layer_types = ["sliding_attention"] * len(model.config.layer_types)
    assert decode_step.decoder_parts(model) is None
    model = load(tmp_path_factory, "llama")
    model.model.rotary_emb.rope_type = "dynamic"  # frequencies follow the sequence length: no precomputed table
    assert decode_step.decoder_parts(model) is None


def test_projections_fuse_only_when_their_call_is_a_plain_linear():
    """A fused matmul reproduces F.linear on concatenated weights; a layer whose call is anything else (its
    forward replaced without naming the kernel it computes, a hook, LoRA) is called as a module."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6)
    x = torch.randn(3, 8)
    fn, weight, bias = decode_step._fuse([a, b])
    assert fn is torch.nn.functional.linear
    assert torch.allclose(fn(x, weight, bias), torch.cat([a(x), b(x)], -1), atol=1e-6)
    assert decode_step._fuse([a, torch.nn.Linear(8, 6, bias=False)]) is None
    b.forward = lambda inp: inp[:, :6]
    assert decode_step._fuse([a, b]) is None
    from grpo_cli.train.backends import cpu_linear  # names its kernel: both layers routed → fused through that kernel
    pair = [torch.nn.Linear(512, 512), torch.nn.Linear(512, 1024)]
    assert cpu_linear.install(torch.nn.Sequential(*pair)) == 2
    fn, weight, bias = decode_step._fuse(pair)
    assert fn is cpu_linear.route
    x = torch.randn(3, 512)
    assert torch.allclose(fn(x, weight, bias), torch.cat([pair[0](x), pair[1](x)], -1), atol=1e-4)
    assert decode_step._fuse([pair[0], torch.nn.Linear(512, 128)]) is None  # different kernels
    big = torch.nn.Linear(1024, decode_step.FUSE_MAX_BYTES // 4096 + 1)  # > FUSE_MAX_BYTES of float32 weights
    assert decode_step._fuse([big]) is None and decode_step._fuse([torch.nn.Linear(1024, 16)]) is not None
    c = torch.nn.Linear(8, 6)
    c.register_forward_hook(lambda *args: None)
    assert decode_step._fuse([a, c]) is None


def test_lora_model_runs_the_lean_step_through_its_adapters(tmp_path_factory, monkeypatch):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(load(tmp_path_factory, "qwen2"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)).eval()
    parts = decode_step.decoder_parts(model)
    assert parts is not None
    plan = decode_step.plan_decode(parts, max_positions=8)
    assert all(layer.qkv is None and layer.gate_up is not None for layer in plan.layers)  # q/v carry adapters
    lean, calls = run(model, monkeypatch, lean=True, eos=1)
    full, _ = run(model, monkeypatch, lean=False, eos=1)
    assert calls > 0 and torch.equal(lean.tokens, full.tokens)
    assert torch.allclose(lean.logprobs, full.logprobs, atol=1e-5)
