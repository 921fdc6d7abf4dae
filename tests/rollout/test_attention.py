"""`grpo_sdpa` (grouped K/V heads without copies, one-token queries as two matmuls) computes what transformers'
sdpa computes: on a GQA Qwen2 checkpoint with the character tokenizer, the hf engine samples the same tokens with
the same logprobs, those equal the trainer's recompute (< 1e-5), and packed-row logprobs and gradients agree."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.models.attention import NAME, attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf.engine import HFEngine
from grpo_cli.models.logprobs import completion_logprobs
from grpo_cli.train.batch import build_batch


@pytest.fixture(scope="module")
def gqa_checkpoint(tmp_path_factory):
    from grpo_cli.models.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("gqa") / "ckpt", hidden_size=128, num_layers=2,
                                     arch="qwen2", kv_heads=2, chars=True))


def load(path: str, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_implementation(attn))


def prompts(path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    texts = ["please say words", "count to ten, slowly", "hi"]  # different lengths: left padding matters
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                    tokenize=True)["input_ids"] for t in texts]


def test_character_tokenizer_round_trips_text(gqa_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gqa_checkpoint)
    ids = tok("say 2 words!")["input_ids"]
    assert len(ids) == len("say 2 words!") and tok.decode(ids) == "say 2 words!"
    assert tok.decode(prompts(gqa_checkpoint)[2]) == "<user> hi <assistant>"


def test_engine_samples_the_same_with_grpo_sdpa_and_matches_the_trainer(gqa_checkpoint):
    fast, ref = load(gqa_checkpoint, "sdpa"), load(gqa_checkpoint, "eager")
    assert fast.config._attn_implementation == NAME and fast.config.num_key_value_heads == 2
    sampling = SamplingParams(n=4, max_tokens=24, temperature=0.9, seed=3)
    batches = [HFEngine(m, eos_token_ids=[1], pad_token_id=0, shares_policy_weights=True).generate(
        prompts(gqa_checkpoint), sampling) for m in (fast, ref)]
    assert batches[0].completion_ids == batches[1].completion_ids
    a, b = (torch.tensor([x for row in bt.sampler_logprobs for x in row]) for bt in batches)
    assert torch.allclose(a, b, atol=1e-5)
    tb = build_batch(batches[0], group_size=4, pad_token_id=0)
    with torch.no_grad():
        lp = completion_logprobs(fast, tb.input_ids, tb.attention_mask, logits_to_keep=tb.num_completion_tokens,
                                 temperature=0.9)
    assert (lp * tb.completion_mask - tb.sampler_logprobs).abs().max() < 1e-5


def test_packed_training_forward_and_gradients_equal_eager(gqa_checkpoint):
    ids_rows = prompts(gqa_checkpoint)
    torch.manual_seed(0)
    width = max(map(len, ids_rows))
    ids = torch.zeros(12, width + 10, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j in range(12):
        p, n = ids_rows[j // 4], 1 + (3 * j) % 10
        ids[j, width - len(p) : width] = torch.tensor(p)
        ids[j, width : width + n] = torch.randint(6, 100, (n,))
        mask[j, width - len(p) : width + n] = 1
    out = []
    for attn in ("sdpa", "eager"):
        model = load(gqa_checkpoint, attn).train()
        lp = completion_logprobs(model, ids, mask, logits_to_keep=10, temperature=1.0)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        out.append((lp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5)
    for name, g in out[1][1].items():
        assert torch.allclose(out[0][1][name], g, atol=1e-6, rtol=1e-4), name
