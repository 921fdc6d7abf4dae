"""The hf engine with images: it samples from the image-conditioned distribution (its sampler logprobs equal a by-hand
forward of each row alone, the image/video placeholders left out of the softmax: they are never sampled), and its
`score` with images equals the trainer's logprobs (the weight-sync probe's comparison); on the tiny Qwen2-VL and
Qwen2.5-VL (`any_vlm`)."""

from __future__ import annotations

import torch
from vision_rows import by_hand, load_vlm, vlm_prompts

from grpo_cli.data.images import ImageProcessor
from grpo_cli.data.prompts import images_of, vision_of
from grpo_cli.models.vision import placeholder_ids
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf.engine import HFEngine
from grpo_cli.train.batch import batch_logprobs, build_batch


def _engine(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok, HFEngine(load_vlm(path), eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                         shares_policy_weights=True, images=ImageProcessor.load(path, max_pixels=10**6))


def test_hf_engine_samples_with_the_images_and_its_logprobs_match_the_trainer(any_vlm):
    tok, engine = _engine(any_vlm)
    _, prompts = vlm_prompts(any_vlm)
    assert engine.accepts_images
    banned = placeholder_ids(engine.model.config)
    out = engine.generate([p.ids for p in prompts], SamplingParams(n=3, max_tokens=6, seed=0),
                          images=images_of(prompts))
    assert not any(t in banned for c in out.completion_ids for t in c)
    for j, c in enumerate(out.completion_ids):
        expected = by_hand(engine.model, prompts[j // 3], c, banned=banned)
        torch.testing.assert_close(torch.tensor(out.sampler_logprobs[j], dtype=torch.float64), expected,
                                   atol=1e-4, rtol=0)
    # the trainer's logprobs of the same batch (the full softmax) against the engine's `score`
    batch = build_batch(out, group_size=3, pad_token_id=tok.pad_token_id, vision=vision_of(prompts))
    trainer = batch_logprobs(engine.model, batch, micro_batch_size=4, temperature=1.0)
    sequences = [prompts[j // 3].ids + c for j, c in enumerate(out.completion_ids)]
    scored = engine.score(sequences, images=[prompts[j // 3].images or [] for j in range(len(sequences))])
    for j, c in enumerate(out.completion_ids):
        got = torch.tensor(scored[j][len(prompts[j // 3].ids) - 1:])
        torch.testing.assert_close(got, trainer[j, : len(c)], atol=1e-5, rtol=0)


def test_hf_engine_generation_depends_on_the_image(tiny_vlm):
    """Greedy-ish sampling with one seed: the same prompt with another image yields other logprobs."""
    _, engine = _engine(tiny_vlm)
    _, prompts = vlm_prompts(tiny_vlm)
    one = prompts[1]
    other = [img.transpose(0) for img in one.images]  # mirrored: another image, same size
    sampling = SamplingParams(n=1, max_tokens=3, seed=0)
    a = engine.score([one.ids + [10, 11]], images=[one.images])[0]
    b = engine.score([one.ids + [10, 11]], images=[other])[0]
    assert max(abs(x - y) for x, y in zip(a[-2:], b[-2:])) > 1e-4
    assert engine.generate([one.ids], sampling, images=[one.images]).completion_ids


def test_rollout_compile_is_refused_for_a_vlm(tiny_vlm):
    """The VLM decodes through its full forward (M-RoPE, images): the lean compiled step would change nothing."""
    import pytest

    from grpo_cli.config.errors import UserError
    from grpo_cli.rollout.hf.engine import require_compilable

    with pytest.raises(UserError, match="rollout.compile compiles the lean decode step .* "
                                        "Qwen2VLForConditionalGeneration decodes through its full forward"):
        require_compilable(load_vlm(tiny_vlm))
