"""One decode step of a Llama-family decoder (Llama, Qwen2, Qwen3) without transformers' per-call machinery.

A decode step feeds one token per row. At small and mid sizes the step's cost is its number of operator calls, not
its arithmetic: transformers' forward spends most of it in Python around the math (output-capturing and kwargs
decorators, a 4D mask built from the 2D mask every step, cache bookkeeping, the attention dispatch, an RMSNorm of
seven elementwise calls, a rotary embedding recomputed from the positions). This step computes the same functions in
transformers' order with fewer calls, writes the new keys/values at slot `end − 1` of the preallocated cache and
attends over every slot with an additive mask that is −inf on padding and on slots not written yet (the same shapes
at every step, so `rollout.compile` compiles it once; masked slots add exp(−inf) = 0):

    x ← embed(token);  cos, sin ← rows `position` of a table computed once by the model's rotary module
    per layer:  h = rms₁(x);  [q | k | v] = h·[W_q | W_k | W_v]ᵀ + [b_q | b_k | b_v]  (one matmul)
                q, k ← rms_q(q), rms_k(k) on Qwen3;  q, k ← q·cos + rot(q)·sin, …
                K[:, :, end−1], V[:, :, end−1] ← k, v
                x ← x + o_proj(softmax(q·Kᵀ·scale + bias) · V)
                [g | u] = rms₂(x)·[W_gate | W_up]ᵀ  (one matmul);  x ← x + down(act(g) · u)
    logits = lm_head(rms(x))

    rms(x) = w · x / √(mean(x²) + ε) (one `F.rms_norm` call on float32 inputs, the module otherwise);
    rot(x) = [−x₂, x₁] over the halves of the last dimension, computed as roll(x, D/2)·[−1 | 1].

Projections are fused only when they are `nn.Linear`s holding plain tensors and computing the same kernel (F.linear,
or the one `model.cpu_linear` installed) and their weights are small enough that a saved call matters
(`FUSE_MAX_BYTES`); LoRA-wrapped ones (PEFT) and large ones are called as modules. The logits agree with
transformers' forward with `grpo_sdpa` attention (`rollout.attention`) to float rounding (tested against the full
forward on each supported architecture). Anything else (other architectures, sliding-window layers, dynamic RoPE, a
growing cache, autocast) keeps the full forward.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grpo_cli.models.linear_fn import linear_fn as _linear_fn
from grpo_cli.rollout.hf.sampling import pick_tokens, process_logits

SUPPORTED_ATTENTION = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention"})
"""Attention classes whose forward is: q/k/v projections (+ optional q/k head RMSNorm), rotary embedding, cache
update, scaled-dot-product attention with `module.scaling`, o_proj — what `decode_logits` reproduces."""

RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
"""Norm classes computing weight · x / √(mean(x²) + variance_epsilon) in float32, which `F.rms_norm` computes."""

GATED_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP"})
"""MLP classes computing down_proj(act_fn(gate_proj(x)) · up_proj(x))."""


@dataclass
class DecoderParts:
    embed: nn.Module
    rotary: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    lm_head: nn.Module


def decoder_parts(model: nn.Module) -> DecoderParts | None:
    """The modules `decode_logits` runs for `model` (a transformers causal LM, or a PEFT model around one), or None
    when its forward is not the Llama-family forward this step reproduces."""
    if hasattr(model, "get_base_model"):  # PEFT: LoRA layers sit inside the base model's projections
        model = model.get_base_model()
    inner, lm_head = getattr(model, "model", None), getattr(model, "lm_head", None)
    layers = getattr(inner, "layers", None)
    if lm_head is None or layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "norm"):
        return None
    config = model.config.get_text_config(decoder=True)
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        return None  # frequencies that change with the sequence length: the table below would not hold
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if type(attn).__name__ not in SUPPORTED_ATTENTION or getattr(attn, "sliding_window", None) is not None:
            return None
        if not all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return None
    return DecoderParts(inner.embed_tokens, inner.rotary_emb, list(layers), inner.norm, lm_head)


def preallocated(cache, end: int) -> bool:
    """Whether every layer of `cache` holds preallocated keys/values with at least `end` slots."""
    from transformers.cache_utils import StaticLayer

    return all(isinstance(layer, StaticLayer) and getattr(layer, "is_initialized", False)
               and layer.keys.shape[2] >= end for layer in cache.layers)




FUSE_MAX_BYTES = 8 << 20
"""Largest concatenated weight `_fuse` builds (a copy held for one generation). A call saved is worth ~20–40 µs;
beyond a few MB of weights the matmul itself takes milliseconds at decode batch sizes, so the copy's memory (most
of a large model's parameters) would buy nothing measurable (18.9M model, 5.5 MB per layer: 65.5 vs 66.0 ms per
step)."""


def _fuse(modules: list[nn.Module]):
    """(fn, [W₁; W₂; …], [b₁; b₂; …]) for linears sharing an input and computing the same `_linear_fn` (one call
    computes all their outputs), or None when any is not such a linear, their kernels/biases/dtypes differ or the
    weights together exceed `FUSE_MAX_BYTES`."""
    fns = {_linear_fn(m) for m in modules}
    if len(fns) != 1 or None in fns or len({m.weight.dtype for m in modules}) != 1:
        return None
    if sum(m.weight.numel() * m.weight.element_size() for m in modules) > FUSE_MAX_BYTES:
        return None
    biases = [m.bias for m in modules]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    weight = torch.cat([m.weight.detach() for m in modules])
    return fns.pop(), weight, (None if biases[0] is None else torch.cat([b.detach() for b in biases]))


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for a transformers RMSNorm: one `F.rms_norm` call on float32 input (the same float32 math as the
    module's seven calls), the module itself otherwise."""
    if type(norm).__name__ in RMS_NORMS and x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)


class _Layer:
    """One decoder layer's decode-step calls, with q/k/v and gate/up each one matmul where the layer allows."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.attn = layer, layer.self_attn
        attn = self.attn
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp = layer.mlp
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj]) if type(mlp).__name__ in GATED_MLPS else None

    def refresh(self) -> None:
        """The fused copies rewritten in place from the projections' current weights (a graph reads them there)."""
        mlp = self.layer.mlp
        for fused, modules in ((self.qkv, (self.attn.q_proj, self.attn.k_proj, self.attn.v_proj)),
                               (self.gate_up, (mlp.gate_proj, mlp.up_proj))):
            if fused is not None:
                torch.cat([m.weight.detach() for m in modules], out=fused[1])
                if fused[2] is not None:
                    torch.cat([m.bias.detach() for m in modules], out=fused[2])

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[q | k] (B, H + KV, D) and v (B, KV, D) of the normed input h (B, hidden)."""
        attn, batch, dim = self.attn, h.shape[0], self.head_dim
        if self.qkv is not None:
            fn, weight, bias = self.qkv
            out = fn(h, weight, bias).view(batch, -1, dim)
            return out[:, : self.heads + self.kv_heads], out[:, self.heads + self.kv_heads :]
        q, k, v = (proj(h).view(batch, -1, dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        return torch.cat((q, k), 1), v

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        mlp = self.layer.mlp
        if self.gate_up is None:
            return mlp(h)
        fn, weight, bias = self.gate_up
        gate, up = fn(h, weight, bias).chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)


@dataclass
class DecodePlan:
    """What `decode_logits` runs: the parts, each layer's (fused) calls, and RoPE's cos and sign-folded sin for
    positions [0, max_positions) — computed once by the model's rotary module, so each step only gathers rows."""

    parts: DecoderParts
    layers: list[_Layer]
    cos: torch.Tensor  # (max_positions, D)
    signed_sin: torch.Tensor  # (max_positions, D): sin · [−1 … −1 | 1 … 1], so rot(x)·sin = roll(x, D/2)·signed_sin

    def refresh(self) -> None:
        """The fused weights copied from the model again, in place: a plan kept for another generation
        (`static_step.StepStore`) computes with the weights of the last update. RoPE's tables do not change."""
        for layer in self.layers:
            layer.refresh()


def plan_decode(parts: DecoderParts, max_positions: int) -> DecodePlan:
    """A `DecodePlan` for positions < `max_positions`. Fused weights are copies: build the plan after the weights'
    last update, or `refresh` it before another generation."""
    weight = parts.embed.weight
    positions = torch.arange(max_positions, device=weight.device)[None]
    cos, sin = (t[0] for t in parts.rotary(weight[:1], positions))  # the module only reads x's dtype and device
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return DecodePlan(parts, [_Layer(layer) for layer in parts.layers], cos, signed_sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rot(x)·sin with rot(x) = [−x₂, x₁]: the same products and sum as transformers' rotate_half form."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _write_slot(cache: torch.Tensor, slot: int | torch.Tensor, new: torch.Tensor) -> None:
    """cache[:, :, slot] ← new for cache (B, KV, S, D), new (B, KV, D): a slice copy for an int slot (eager; CPU's
    `index_copy_` along dim 2 took ~50 µs per call here), `index_copy_` for a (1,) tensor (compiled: an int slot
    would be a new constant, and a recompile, every step)."""
    if isinstance(slot, int):
        cache[:, :, slot] = new
    else:
        cache.index_copy_(2, slot, new[:, :, None].to(cache.dtype))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
            scale: float) -> torch.Tensor:
    """softmax(q·Kᵀ·scale + bias)·V for q (B, KV, H/KV, D) over keys/values (B, KV, S, D): (B, KV, H/KV, D).

    Eager: two batched matmuls. Compiled: the same sums written as products reduced over D and S, which inductor
    fuses into loops that never hold the (B, KV, H/KV, S, D) products (MKL's batched matmul spends ~0.5 µs per
    2 × 32 · 32 × S matrix at these sizes)."""
    if torch.compiler.is_compiling():
        scores = (q[:, :, :, None, :] * keys[:, :, None].to(q.dtype)).sum(-1).float() * scale + bias
        probs = scores.softmax(-1).to(values.dtype)
        return (probs[..., None] * values[:, :, None]).sum(-2)
    scores = torch.matmul(q, keys.to(q.dtype).transpose(-1, -2)).float() * scale + bias
    return torch.matmul(scores.softmax(-1).to(values.dtype), values)


def decode_logits(plan: DecodePlan, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor,
                  positions: torch.Tensor, slot: int | torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Next-token logits (B, V) after feeding `tokens` (B,) at `positions` (B,), written to slot `slot` (an int, or
    a (1,) long tensor when compiled) of each layer's preallocated `keys`/`values` (B, KV, S, D). `bias` (B, 1, 1, S) float32 is 0 at the slots a row
    attends to and −inf elsewhere (its prompt padding, slots not written yet): attention runs over all S slots, so
    every step has the same shapes (what lets `compiled_decode_sample` compile the step once)."""
    parts = plan.parts
    batch = tokens.shape[0]
    x = parts.embed(tokens)  # (B, hidden)
    cos, sin = plan.cos[positions][:, None], plan.signed_sin[positions][:, None]  # (B, 1, D) → every head
    for step, layer_keys, layer_values in zip(plan.layers, keys, values, strict=True):
        attn = step.attn
        qk, v = step.project(_rms(step.layer.input_layernorm, x))
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each q and k head before RoPE
            q, k = qk.split((step.heads, step.kv_heads), 1)
            qk = torch.cat((_rms(attn.q_norm, q), _rms(attn.k_norm, k)), 1)
        q, k = _rotate(qk, cos, sin).split((step.heads, step.kv_heads), 1)
        _write_slot(layer_keys, slot, k)
        _write_slot(layer_values, slot, v)
        q = q.reshape(batch, step.kv_heads, -1, step.head_dim)  # (B, KV, H/KV, D)
        x = x + attn.o_proj(_attend(q, layer_keys, layer_values, bias, attn.scaling).to(x.dtype).reshape(batch, -1))
        x = x + step.mlp(_rms(step.layer.post_attention_layernorm, x))
    return parts.lm_head(_rms(parts.norm, x))


def decode_sample(plan: DecodePlan, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor,
                  positions: torch.Tensor, slot: int | torch.Tensor, bias: torch.Tensor, noise: torch.Tensor, *,
                  temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_logits`, then the next tokens and their logprobs (B,) drawn from them: `process_logits` of the fp32
    logits and `pick_tokens` with the uniform `noise` (B, V) the caller drew from its generator."""
    logits = decode_logits(plan, keys, values, tokens, positions, slot, bias)
    return pick_tokens(process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p), noise)


_compiled = None


def compiled_decode_sample():
    """`decode_sample` under `torch.compile` (inductor: the step's elementwise calls, sampling included, fused into
    a few loops, the per-call dispatch gone), built on first use and shared by every plan; inductor caches the code
    on disk, so a later process compiles in seconds. A step torch.compile cannot build runs eagerly instead
    (`with_eager_fallback`)."""
    global _compiled
    if _compiled is None:
        _compiled = with_eager_fallback(torch.compile(decode_sample))
    return _compiled


def with_eager_fallback(compiled):
    """`compiled`, falling back to the eager `decode_sample` for good (with a warning naming the failure) the first
    time torch.compile fails to build it: a compile failure happens before the step runs, so nothing was written
    and the same call is repeated eagerly."""
    state = {"fn": compiled}

    def step(*args, **kwargs):
        try:
            return state["fn"](*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if state["fn"] is decode_sample:
                raise
            state["fn"] = decode_sample
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            warnings.warn(f"rollout.compile: torch.compile could not build the decode step ({reason}); this "
                          "process decodes eagerly from here on (same tokens, without the compiled speed-up).",
                          RuntimeWarning, stacklevel=2)
            return decode_sample(*args, **kwargs)

    return step
