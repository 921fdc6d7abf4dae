"""The hf engine's own decode loop on the tiny checkpoint: sampler logprobs equal the trainer's recompute, seeds
are deterministic, stop tokens end rows, finished rows dropped mid-decode change nothing about the contract, and the
logit processing is transformers' (temperature → top-k → top-p)."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf.engine import HFEngine
from grpo_cli.rollout.hf.sampling import process_logits, sample_tokens
from grpo_cli.models.logprobs import completion_logprobs
from grpo_cli.train.batch import build_batch

PROMPTS = [[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]]  # different lengths: left padding matters
EOS = 1


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


def engine(model, eos: int = EOS) -> HFEngine:
    return HFEngine(model, eos_token_ids=[eos], pad_token_id=0, shares_policy_weights=True)


def recompute(model, batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    tb = build_batch(batch, group_size=len(batch.completion_ids) // len(batch.prompt_ids), pad_token_id=0)
    with torch.no_grad():
        lp = completion_logprobs(model, tb.input_ids, tb.attention_mask, logits_to_keep=tb.num_completion_tokens,
                                 temperature=temperature)
    return lp, tb


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_match_the_trainer(model, temperature):
    batch = engine(model).generate(PROMPTS, SamplingParams(n=4, max_tokens=10, temperature=temperature, seed=5))
    lp, tb = recompute(model, batch, temperature)
    assert len(batch.completion_ids) == 16 and all(1 <= len(c) <= 10 for c in batch.completion_ids)
    assert torch.allclose(lp * tb.completion_mask, tb.sampler_logprobs, atol=1e-5)


def test_rows_drop_out_mid_decode_without_changing_the_contract(model, monkeypatch):
    """A frequent stop token (id 6 under this random model) makes rows finish early; compacting at every finish."""
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", 0.0)
    eng = engine(model, eos=6)
    batch = eng.generate(PROMPTS, SamplingParams(n=8, max_tokens=12, seed=1))
    lengths = [len(c) for c in batch.completion_ids]
    assert len(set(lengths)) > 2, lengths  # rows stopped at different steps
    for c, reason in zip(batch.completion_ids, batch.finish_reasons, strict=True):
        assert (reason == "stop") == (c[-1] == 6) and 6 not in c[:-1]
        assert reason == "stop" or len(c) == 12
    lp, tb = recompute(model, batch, 1.0)
    assert torch.allclose(lp * tb.completion_mask, tb.sampler_logprobs, atol=1e-5)


def test_same_seed_same_batch_and_the_policy_mode_is_kept(model):
    eng = engine(model)
    model.train()
    a = eng.generate(PROMPTS, SamplingParams(n=3, max_tokens=8, seed=7))
    b = eng.generate(PROMPTS, SamplingParams(n=3, max_tokens=8, seed=7))
    c = eng.generate(PROMPTS, SamplingParams(n=3, max_tokens=8, seed=8))
    assert model.training
    model.eval()
    assert a.completion_ids == b.completion_ids and a.sampler_logprobs == b.sampler_logprobs
    assert a.completion_ids != c.completion_ids
    assert a.prompt_ids == PROMPTS and a.timings["generate"] > 0


def test_dynamic_cache_fallback_samples_the_same(model, monkeypatch):
    static = engine(model).generate(PROMPTS, SamplingParams(n=2, max_tokens=8, seed=3))
    monkeypatch.setattr(type(model), "_can_compile_fullgraph", False)
    dynamic = engine(model).generate(PROMPTS, SamplingParams(n=2, max_tokens=8, seed=3))
    assert static.completion_ids == dynamic.completion_ids
    assert torch.allclose(torch.tensor(sum(static.sampler_logprobs, [])),
                          torch.tensor(sum(dynamic.sampler_logprobs, [])), atol=1e-5)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.6, 5, 1.0), (1.3, 0, 0.8),
                                                             (0.9, 7, 0.5), (1.0, 200, 0.999)])
def test_processing_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    logits[0, :3] = 5.0  # ties at the top-k boundary
    ref = logits.clone()
    if temperature != 1.0:
        ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.allclose(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_sampled_tokens_follow_the_softmax():
    """Gumbel-max draws: frequencies over 40,000 draws match softmax(scores) within 4 standard errors; a -inf
    (filtered) token is never drawn; the same generator seed gives the same tokens."""
    scores = torch.tensor([[0.0, 1.0, -1.0, 2.0, float("-inf"), 0.5]]).expand(40_000, -1).contiguous()
    tokens, _ = sample_tokens(scores, torch.Generator().manual_seed(3))
    freq = torch.bincount(tokens, minlength=6).double() / len(tokens)
    probs = torch.softmax(scores[0].double(), -1)
    stderr = (probs * (1 - probs) / len(tokens)).sqrt()
    assert freq[4] == 0 and ((freq - probs).abs() <= 4 * stderr + 1e-12).all(), (freq, probs)
    again, _ = sample_tokens(scores, torch.Generator().manual_seed(3))
    assert torch.equal(tokens, again)


def test_sampled_tokens_are_never_filtered_and_logprobs_are_log_softmax():
    torch.manual_seed(1)
    scores = process_logits(torch.randn(64, 30), temperature=1.0, top_k=4, top_p=1.0)
    tokens, logprobs = sample_tokens(scores, torch.Generator().manual_seed(0))
    assert torch.isfinite(scores.gather(1, tokens[:, None])).all()
    assert torch.allclose(logprobs, torch.log_softmax(scores, -1).gather(1, tokens[:, None]).squeeze(1))


def test_the_draw_is_argmax_of_scores_minus_log_minus_log_noise_and_leaves_its_inputs():
    """`pick_tokens` computes the Gumbel perturbation in place (one (B, V) temporary): the same tokens as the
    out-of-place formula, on ties too, and neither the scores nor the noise (the static step's reused buffer)
    change."""
    from grpo_cli.rollout.hf.sampling import pick_tokens

    g = torch.Generator().manual_seed(5)
    scores = torch.randn(64, 300, generator=g)
    scores[:, 7] = float("-inf")
    noise = torch.rand(64, 300, generator=g)
    saved = scores.clone(), noise.clone()
    tokens, _ = pick_tokens(scores, noise)
    assert torch.equal(tokens, (scores - noise.log().neg().log()).argmax(-1))
    assert torch.equal(scores, saved[0]) and torch.equal(noise, saved[1])
