"""MoE expert tensors under their checkpoint names (what transformers 5 fuses, checkpoints and engines keep apart)."""

from __future__ import annotations

import torch


def expert_parts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A parameter under its checkpoint names: transformers 5 holds a MoE layer's experts fused,
    `…mlp.experts.gate_up_proj` (E, 2I, H) and `…mlp.experts.down_proj` (E, H, I), while checkpoints, vLLM and
    mbridge name them per expert: `…mlp.experts.{e}.gate_proj.weight` = rows [0, I) of expert e, `up_proj` =
    rows [I, 2I), `down_proj` = its (H, I) matrix. Views of `tensor` (writing into one writes the fused
    parameter); any other parameter is `[(name, tensor)]`."""
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        if name.endswith(f"mlp.experts.{fused}") and tensor.dim() == 3:
            stem, size = name[: -len(fused)], tensor.shape[1] // len(parts)
            return [(f"{stem}{e}.{part}.weight", tensor[e, k * size:(k + 1) * size])
                    for e in range(tensor.shape[0]) for k, part in enumerate(parts)]
    return [(name, tensor)]
