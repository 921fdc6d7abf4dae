"""One decode step of a Llama-family decoder (Llama, Qwen2, Qwen3) without transformers' per-call machinery.

A decode step feeds one token per row. transformers' forward spends most of a small model's step in Python around
the math: output-capturing and kwargs decorators, a 4D mask built from the 2D mask every step, cache bookkeeping
and the attention dispatch, and its preallocated cache hands attention every slot, the unwritten ones masked. This
step calls the same modules (embedding, rotary embedding, norms, projections, MLP, final norm, LM head) in
transformers' order, writes the new keys/values at slot `end − 1` of the preallocated cache and attends over
slots [0, end) only:

    x ← embed(token);  cos, sin ← rotary(x, position)
    per layer:  h = norm₁(x);  q, k, v = proj(h) (q/k head norms on Qwen3);  q, k ← q·cos + rot(q)·sin, …
                K[:, :, end−1], V[:, :, end−1] ← k, v
                x ← x + o_proj(softmax(q·K[:end]ᵀ·scale, masked where the row's mask is 0) · V[:end])
                x ← x + mlp(norm₂(x))
    logits = lm_head(norm(x))

— the same operations as transformers' forward with `grpo_sdpa` attention (`rollout.attention`), so logits agree to
float rounding (tested against the full forward on each supported architecture). Anything else (other
architectures, sliding-window layers, a growing cache, autocast) keeps the full forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_ATTENTION = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention"})
"""Attention classes whose forward is: q/k/v projections (+ optional q/k head RMSNorm), rotary embedding, cache
update, scaled-dot-product attention with `module.scaling`, o_proj — what `decode_logits` reproduces."""


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁] over the halves of the last dimension."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decode_logits(parts: DecoderParts, cache, tokens: torch.Tensor, positions: torch.Tensor,
                  allowed: torch.Tensor) -> torch.Tensor:
    """Next-token logits (B, V) after feeding `tokens` (B,) at `positions` (B,), written to cache slot
    `allowed.shape[-1] − 1`. `allowed` (B, end) bool: the slots each row attends to (its prompt padding False).
    The caller owns the slot count: the cache's own `cumulative_length` is not advanced (nothing reads it here)."""
    batch, end = allowed.shape
    slot = end - 1
    keep = allowed[:, None, None, :]  # (B, 1, 1, end) → every KV head and query group
    x = parts.embed(tokens[:, None])  # (B, 1, hidden)
    cos, sin = parts.rotary(x, positions[:, None])  # (B, 1, D)
    cos, sin = cos[:, :, None], sin[:, :, None]  # (B, 1, 1, D) → every head
    for layer, kv in zip(parts.layers, cache.layers, strict=True):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(batch, 1, -1, attn.head_dim)
        k = attn.k_proj(h).view(batch, 1, -1, attn.head_dim)
        v = attn.v_proj(h).view(batch, 1, -1, attn.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        kv.keys[:, :, slot] = k[:, 0]
        kv.values[:, :, slot] = v[:, 0]
        keys, values = kv.keys[:, :, :end], kv.values[:, :, :end]  # (B, KV, end, D)
        q = q.reshape(batch, keys.shape[1], -1, attn.head_dim)  # (B, KV, H/KV, D)
        scores = torch.matmul(q, keys.to(q.dtype).transpose(-1, -2)).float() * attn.scaling
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1).to(values.dtype)
        out = torch.matmul(probs, values).to(x.dtype).reshape(batch, 1, -1)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return parts.lm_head(parts.norm(x))[:, -1]
