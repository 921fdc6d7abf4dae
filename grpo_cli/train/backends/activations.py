"""Activation checkpointing of the policy's decoder layers: full (recompute each layer in backward) or selective
(keep matmul and attention outputs, recompute only the cheap elementwise ops: norms, rotary, SiLU, products)."""

from __future__ import annotations

import functools

import torch


def _saved_ops() -> set:
    """The ops whose outputs selective checkpointing keeps: matmuls and fused attention kernels (what is costly
    to recompute); every other op of a layer is re-run in backward."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_fused_sdp_choice"]
    saved = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):  # `model.cpu_linear: onednn`'s matmul
        saved.add(torch.ops.mkldnn._linear_pointwise.default)
    return saved


def _policy(saved, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """`context_fn` for `torch.utils.checkpoint.checkpoint`: selective activation checkpointing with `_policy`."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_policy, _saved_ops()))


def enable_checkpointing(module: torch.nn.Module, mode: bool | str) -> None:
    """Turn on `model.gradient_checkpointing` (`True` = full, `"selective"`) on a Hugging Face model's layers."""
    if mode == "selective":
        module.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": selective_context})
    elif mode:
        module.gradient_checkpointing_enable()
