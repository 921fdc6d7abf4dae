"""float32 `nn.Linear` layers on oneDNN on CPU (`model.cpu_linear`).

PyTorch's CPU builds run float32 matmuls on MKL's SGEMM. On AMD EPYC (the CPU of the reference machine, where
`MKL_VERBOSE` names its generic "Intel(R) Architecture processors" path) oneDNN's AVX-512 kernels are markedly
faster at a transformer's shapes (measured, 2 threads:
y = x·Wᵀ at 8000 × 512 → 1024: 42 vs 70 ms; the input gradient gy·W: 44 vs 65 ms; the weight gradient gyᵀ·x:
MKL's 54 ms beats oneDNN's 62, so it stays on MKL). Same float32 math, another summation order (relative
difference ~1e-6, the size of any GEMM re-blocking).

Below 512 input or output features MKL is as fast or faster: per-call overhead (128 × 128 → 256 took 51 µs on MKL,
56 on oneDNN), and oneDNN creates a primitive for every new row count, which a training forward over a varying
number of packed tokens hits at each step (128 → 128 at 6,500–8,000 random rows: 1.7 ms MKL, 2.4 oneDNN; at a
fixed row count oneDNN would win, 1.3 ms). So `install` replaces the `forward` of each plain `nn.Linear` of at
least `MIN_FEATURES` in and out (LoRA's base layers included) with `linear`: y = x·Wᵀ + b through
`torch.ops.mkldnn._linear_pointwise`, backward ∂x = gy·W (oneDNN), ∂W = gyᵀ·x (MKL), ∂b = Σ gy. Anything else —
autocast (bf16 compute), other dtypes, sharded parameters (DTensor), non-CPU tensors — takes `F.linear` unchanged.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from grpo_cli.config.errors import UserError
from grpo_cli.models.linear_fn import LINEAR_FN_ATTR


def _dnnl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (…, K) · weight (N, K)ᵀ + bias on oneDNN."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("grpo_cli::onednn_linear", mutates_args=())
def _dnnl_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`_dnnl` as an opaque op for `torch.compile` (the hf engine's compiled decode step): inductor cannot lower
    mkldnn's linear with dynamic shapes, so the compiled graph calls this op instead."""
    return _dnnl(x, weight, bias)


@_dnnl_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _dnnl(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _dnnl(grad, weight.t(), None)  # gy · W
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = flat.t() @ x.reshape(-1, x.shape[-1])  # gyᵀ · x (MKL is the faster one here)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = flat.sum(0)
        return gx, gw, gb


def _plain_cpu_float32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (type(t) is torch.Tensor or type(t) is nn.Parameter) and t.dtype == torch.float32
               and t.device.type == "cpu" for t in tensors)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x·Wᵀ + b on oneDNN when the call is a plain CPU float32 one, else `F.linear`."""
    if torch.is_autocast_enabled("cpu") or not _plain_cpu_float32(x, weight, bias):
        return F.linear(x, weight, bias)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if torch.compiler.is_compiling():  # the opaque op (no gradient); a graph that trains keeps F.linear
        return F.linear(x, weight, bias) if needs_grad else _dnnl_op(x, weight, bias)
    if needs_grad:
        return _OneDNNLinear.apply(x, weight, bias)
    return _dnnl(x, weight, bias)


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module`'s forward through `route`."""
    return route(x, module.weight, module.bias)


def available() -> bool:
    """Whether this torch build has oneDNN's linear op and it computes F.linear here (checked once on a random
    (64, 96) · (48, 96)ᵀ + b, to 1e-5 relative)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*s, generator=g) for s in ((64, 96), (48, 96), (48,)))
            ref = F.linear(x, w, b)
            _AVAILABLE = bool(torch.backends.mkldnn.is_available()) and torch.allclose(
                _dnnl(x, w, b), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        except (RuntimeError, AttributeError, NotImplementedError):
            _AVAILABLE = False
    return _AVAILABLE


_AVAILABLE: bool | None = None


MIN_FEATURES = 512
"""Smallest in/out feature count routed to oneDNN (measured crossover, module docstring)."""


def install(model: nn.Module) -> int:
    """Route every plain `nn.Linear` of `model` with ≥ MIN_FEATURES in and out features through `linear` (and mark
    it as computing `route`, which the hf engine's fused decode projections then call); returns how many layers
    it covers."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and min(module.in_features, module.out_features) >= MIN_FEATURES:
            module.forward = types.MethodType(linear, module)
            setattr(module, LINEAR_FN_ATTR, route)
            count += 1
    return count


def use_onednn_linear(setting: str, device: torch.device, *models: nn.Module | None) -> bool:
    """Apply `model.cpu_linear` (`auto`/`onednn`/`aten`) to the policy and reference models on `device`; returns
    whether the oneDNN linear is installed on any layer. `onednn` where it cannot run is a UserError naming the fix."""
    if setting == "aten":
        return False
    if device.type != "cpu" or not available():
        if setting == "onednn":
            where = f"the models train on {device.type}" if device.type != "cpu" else \
                "this torch build's oneDNN linear op is missing or disagrees with F.linear"
            raise UserError(f"model.cpu_linear 'onednn' cannot apply: {where}. Set model.cpu_linear=auto or aten.")
        return False
    installed = sum(install(model) for model in models if model is not None)
    if setting == "onednn" and not installed:
        raise UserError(f"model.cpu_linear 'onednn' applies to linear layers with at least {MIN_FEATURES} input and "
                        "output features, and this model has none (below that MKL is as fast); set "
                        "model.cpu_linear=auto or aten.")
    return installed > 0
