"""Vision-language rows through the trainer: the logprobs of image prompts equal a by-hand forward of each row alone
(the model's own M-RoPE positions, no padding, float64 log-softmax) whatever the micro-batching (rows or token
budgets), rows with 0, 1 and 2 images of different sizes mixed; a frozen vision tower is left bit-identical by
training; LoRA adapts the language model only; what a VLM run refuses. The logprob, freeze and fsdp2-unit tests run on
both tiny architectures (`any_vlm`: Qwen2-VL and Qwen2.5-VL)."""

from __future__ import annotations

import random

import pytest
import torch
from vision_rows import by_hand, load_vlm, vlm_prompts

from grpo_cli.data.prompts import vision_of
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.batch import batch_logprobs, build_batch


def test_trainer_logprobs_of_image_prompts_equal_a_by_hand_forward_whatever_the_micro_batching(any_vlm):
    tok, prompts = vlm_prompts(any_vlm)
    assert [0 if p.vision is None else p.vision.num_images for p in prompts] == [0, 1, 2]
    assert [p.ids.count(8) for p in prompts] == [0, 4, 2 + 4]  # 56×56 → 4 tokens, 28×56 → 2
    model = load_vlm(any_vlm)
    g, rng = 2, random.Random(1)
    words = [i for i in range(10, len(tok))]  # no special or vision token
    completions = [[rng.choice(words) for _ in range(n)] for n in (3, 5, 1, 4, 2, 5)]
    rollout = RolloutBatch(prompt_ids=[p.ids for p in prompts], completion_ids=completions,
                           finish_reasons=["stop"] * len(completions))
    batch = build_batch(rollout, group_size=g, pad_token_id=tok.pad_token_id, vision=vision_of(prompts))
    assert batch.vision.images_per_row.tolist() == [0, 0, 1, 1, 2, 2]
    expected = [by_hand(model, prompts[j // g], c) for j, c in enumerate(completions)]
    for micro, tokens in ((1, None), (2, None), (len(batch), None), (len(batch), 40)):
        # (…, 40): token-budget micro-batches (`train.micro_batch_tokens`), rows regrouped longest first
        got = batch_logprobs(model, batch, micro_batch_size=micro, temperature=1.0, micro_batch_tokens=tokens)
        for j, c in enumerate(completions):
            torch.testing.assert_close(got[j, : len(c)].double(), expected[j], atol=1e-5, rtol=0)
            assert torch.all(got[j, len(c):] == 0)
    # the images matter: the same rows without them give other logprobs
    blind = batch_logprobs(model, build_batch(rollout, group_size=g, pad_token_id=tok.pad_token_id),
                           micro_batch_size=len(batch), temperature=1.0)
    assert (blind[2:] - got[2:]).abs().max() > 1e-3


def test_select_takes_each_rows_own_images(tiny_vlm):
    _, prompts = vlm_prompts(tiny_vlm)
    vision = build_batch(RolloutBatch(prompt_ids=[p.ids for p in prompts], completion_ids=[[10]] * 3,
                                      finish_reasons=["stop"] * 3), group_size=1, pad_token_id=0,
                         vision=vision_of(prompts)).vision
    picked = vision.select([2, 1])
    assert picked.images_per_row.tolist() == [2, 1]
    assert picked.image_grid_thw.tolist() == [[1, 4, 2], [1, 4, 4], [1, 4, 4]]
    torch.testing.assert_close(picked.pixel_values[:8], prompts[2].vision.pixel_values[:8], atol=0, rtol=0)
    torch.testing.assert_close(picked.pixel_values[24:], prompts[1].vision.pixel_values, atol=0, rtol=0)
    assert vision.rows(0, 1).num_images == 0


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_vision_keeps_the_tower_bit_identical(any_vlm, freeze):
    """`model.freeze_vision`: the tower's parameters leave the optimizer and keep their bits through optimizer
    steps that move the language model (with the flag off, they move too); each architecture's tower is found by
    its parameter names (Qwen2.5-VL's window-attention blocks and gated MLPs among them)."""
    from grpo_cli.config.load import build_config
    from grpo_cli.models.vision import is_vision_parameter
    from grpo_cli.train.backends.base import make_adamw
    from grpo_cli.train.backends.hf_io import load_hf_model

    cfg = build_config(overrides=[f"model.freeze_vision={str(freeze).lower()}", "train.learning_rate=0.01"])
    model = load_hf_model(cfg, any_vlm, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_adamw(cfg, list(model.parameters()))
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    vision = [n for n, _ in model.named_parameters() if is_vision_parameter(n)]
    assert vision and all((id(p) in in_optimizer) != freeze for n, p in model.named_parameters() if n in vision)
    _, prompts = vlm_prompts(any_vlm)
    rollout = RolloutBatch(prompt_ids=[p.ids for p in prompts], completion_ids=[[10, 11]] * 3,
                           finish_reasons=["stop"] * 3)
    batch = build_batch(rollout, group_size=1, pad_token_id=0, vision=vision_of(prompts))
    from grpo_cli.models.logprobs import completion_logprobs

    for _ in range(2):
        lp = completion_logprobs(model, batch.input_ids, batch.attention_mask, logits_to_keep=2, temperature=1.0,
                                 vision=batch.vision)
        lp.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in vision) == freeze
    assert not torch.equal(before["model.language_model.layers.0.mlp.up_proj.weight"],
                           after["model.language_model.layers.0.mlp.up_proj.weight"])


def test_a_vision_run_refuses_megatron_and_engines_without_images(tiny_vlm):
    """megatron is refused for a VLM (by the config rules, before the model loads); a rollout loop that passes no images
    (`rollout.custom`, whose wrapper does not declare `accepts_images`) is refused once the prompts show images
    (never called: any callable does)."""
    from grpo_cli.config.errors import UserError
    from grpo_cli.config.load import build_config
    from grpo_cli.runtime.dist import DistInfo
    from grpo_cli.train.run import build_trainer

    base = ["model.name_or_path=builtin:tiny-vlm", "data.source=builtin:shapes"]
    with pytest.raises(UserError, match="is a vision-language model, but distributed.backend 'megatron' builds "
                                        "Megatron-core GPT models from a text-only language model's config"):
        build_trainer(build_config(overrides=[*base, "distributed.backend=megatron"]), DistInfo(),
                      torch.device("cpu"), log=lambda *_: None)
    cfg = build_config(overrides=[*base, "rollout.custom=json:dumps"])
    with pytest.raises(UserError, match=r"carry images, and the rollout engine here \(hf, mode colocate, "
                                        r"rollout.custom\) generates from text only"):
        build_trainer(cfg, DistInfo(), torch.device("cpu"), log=lambda *_: None)


def test_lora_adapts_the_language_model_only(tiny_vlm):
    """`model.lora` (all-linear) on a VLM: adapters on the language model's projections, none in the vision tower;
    the PEFT-wrapped model takes image rows (positions from the base model) and, with B = 0 at init, gives the
    base model's logprobs."""
    from grpo_cli.config.load import build_config
    from grpo_cli.models.logprobs import completion_logprobs
    from grpo_cli.train.weights.lora import apply_lora

    model = load_vlm(tiny_vlm)
    _, prompts = vlm_prompts(tiny_vlm)
    batch = build_batch(RolloutBatch(prompt_ids=[p.ids for p in prompts], completion_ids=[[10, 11]] * 3,
                                     finish_reasons=["stop"] * 3), group_size=1, pad_token_id=0,
                        vision=vision_of(prompts))

    def logprobs(m):
        return completion_logprobs(m, batch.input_ids, batch.attention_mask, logits_to_keep=2, temperature=1.0,
                                   vision=batch.vision)

    base = logprobs(model)
    lora = apply_lora(build_config(overrides=["model.lora.r=4"]), model)
    adapted = [n for n, _ in lora.named_parameters() if "lora_A" in n]
    assert adapted and not any(".visual." in n for n in adapted)
    assert any("language_model.layers.0.self_attn.q_proj" in n for n in adapted)
    torch.testing.assert_close(logprobs(lora), base, atol=1e-6, rtol=0)


def test_a_local_vlm_folder_is_sized_by_its_language_model_and_rehearsed_as_one(tiny_vlm):
    """`grpo plan` and the config rules read a VLM's config.json (its sizes nested in `text_config`)."""
    from grpo_cli.config.model_shape import model_shape
    from grpo_cli.launch.rehearse import is_vision_model

    shape = model_shape(tiny_vlm)
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.vocab) == (64, 2, 2, 1, 82)
    assert is_vision_model(tiny_vlm) and is_vision_model("Qwen/Qwen2.5-VL-3B-Instruct")
    assert not is_vision_model("Qwen/Qwen2.5-7B-Instruct")


def test_fsdp2_shards_each_vision_block_and_decoder_layer_of_either_architecture(any_vlm):
    """fsdp2's units are the classes the model lists as `_no_split_modules`: Qwen2-VL's and Qwen2.5-VL's vision
    blocks (window-attention and full-attention ones alike) and decoder layers, 2 of each in the tiny models."""
    from grpo_cli.train.backends.fsdp2 import decoder_layers

    model = load_vlm(any_vlm)
    units = [type(m).__name__ for m in decoder_layers(model)]
    prefix = "Qwen2_5_VL" if model.config.model_type == "qwen2_5_vl" else "Qwen2VL"
    assert sorted(units) == sorted([f"{prefix}DecoderLayer"] * 2 + [f"{prefix}VisionBlock"] * 2)
