"""The kernel an `nn.Linear` computes, for code that calls it directly (the hf engine's fused decode step, the
trainer's chunked output head): `F.linear`, or the faster kernel of the same math a backend installed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_FN_ATTR = "grpo_linear_fn"
"""Attribute set on an `nn.Linear` whose forward was replaced by another kernel of the same y = x·Wᵀ + b (e.g.
`model.cpu_linear`): that function (x, weight, bias) → y, which the fused projections then call."""


def linear_fn(module: nn.Module):
    """The function (x, weight, bias) → y that `module`'s call computes when it is an `nn.Linear` on plain tensors
    (no hooks, no LoRA wrapper, no sharded DTensor): `F.linear`, or the kernel its replaced forward names under
    `LINEAR_FN_ATTR`; None otherwise."""
    if (type(module) is not nn.Linear or module._forward_hooks or module._forward_pre_hooks
            or not all(type(p) in (torch.Tensor, nn.Parameter) for p in (module.weight, module.bias) if p is not None)):
        return None
    return getattr(module, LINEAR_FN_ATTR, None) if "forward" in vars(module) else F.linear
