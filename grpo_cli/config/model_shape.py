"""A model's size and shape from its config.json alone (a local folder; never downloads), or from the size in its
name for the Qwen2.5 dense and Qwen3 dense and MoE families: what `grpo plan` and the config rules size a run by."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    params: float
    hidden: int
    layers: int
    kv_dim: int
    root_params: float = 0.0
    """Parameters outside the decoder layers (embeddings, an untied output head, the final norm): FSDP2's root
    unit, gathered for the whole forward and backward."""
    expert_params: float = 0.0
    """Parameters of the routed MoE experts, all layers together (0 for a dense model): what Megatron's expert
    parallelism splits instead of tensor × pipeline parallelism alone."""
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    heads: int = 0
    """Attention (query) heads; 0 when unknown (then `hidden // 128`, Qwen2.5's head size, stands in)."""
    kv_heads: int = 0
    """Key/value heads; 0 when unknown."""
    vocab: int = 0
    """Vocabulary size; 0 when unknown."""

    @property
    def layer_params(self) -> float:
        """Parameters of one decoder layer (the unit FSDP2 gathers and reduce-scatters at a time)."""
        return (self.params - self.root_params) / self.layers


BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per parameter of each `model.dtype`."""


QWEN_VOCAB = 151_936
KNOWN_SHAPES = {0.5: (896, 24, 128, True), 1.5: (1536, 28, 256, True), 3: (2048, 36, 256, True),
                7: (3584, 28, 512, False), 14: (5120, 48, 1024, False), 32: (5120, 64, 1024, False),
                72: (8192, 80, 1024, False)}
"""Billions → (hidden, layers, kv dim, tied embeddings) of the Qwen2.5 family, for names without a local folder."""
KNOWN_MOE_CONFIGS = {
    "30B-A3B": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": QWEN_VOCAB, "tie_word_embeddings": False},
    "235B-A22B": {"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                  "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                  "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": QWEN_VOCAB,
                  "tie_word_embeddings": False},
}
"""The Qwen3 MoE models' config.json fields `model_shape` reads, by the size in the name ('Qwen/Qwen3-30B-A3B'), for
names without a local folder."""

QWEN3_DENSE = {0.6: (1024, 28, 16, 3072, True), 1.7: (2048, 28, 16, 6144, True), 4: (2560, 36, 32, 9728, True),
               8: (4096, 36, 32, 12288, False), 14: (5120, 40, 40, 17408, False), 32: (5120, 64, 64, 25600, False)}
"""Billions → (hidden, layers, attention heads, intermediate size, tied embeddings) of the dense Qwen3 models (8 key/
value heads of 128, vocabulary 151,936), for names like 'Qwen/Qwen3-8B' without a local folder."""


def qwen3_dense_config(billions: float) -> dict:
    """The config.json fields `model_shape` reads of the dense Qwen3 of that size (a key of `QWEN3_DENSE`)."""
    h, n_layers, heads, inter, tied = QWEN3_DENSE[billions]
    return {"model_type": "qwen3", "hidden_size": h, "num_hidden_layers": n_layers, "num_attention_heads": heads,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": inter, "vocab_size": QWEN_VOCAB,
            "tie_word_embeddings": tied}


TINY_MOE_CONFIG = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128, "moe_intermediate_size": 64,
                   "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 68, "tie_word_embeddings": False}
"""The config.json `builtin:tiny-moe` gets (`models/tiny.py`; a test compares), known without building it."""


def local_model_config(name: str) -> dict | None:
    """The model's config.json when `name` is a local folder that has one (never downloads; None otherwise): what
    `grpo plan` sizes the model by and the config rules check head, layer and expert counts against. A
    vision-language model's has its `text_config` fields on top (the vision tower is left out of the sizes)."""
    path = Path(name) / "config.json"
    try:
        c = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if c is not None and is_vision_config(c):  # a VLM: its language model's sizes (the tower is not counted)
        c = {**c, **(c.get("text_config") or {})}
    return c


def is_vision_config(config) -> bool:
    """Whether a Hugging Face config (or its config.json dict) is a vision-language model's (it has a
    `vision_config`); `models.vision` re-exports it."""
    if isinstance(config, dict):
        return "vision_config" in config
    return getattr(config, "vision_config", None) is not None


VISION_BUILTINS = ("builtin:tiny-vlm", "builtin:tiny-vlm-qwen2.5")


def is_vision_model(name: str) -> bool:
    """Whether `model.name_or_path` is a vision-language model: a built-in one, a local folder whose config.json
    has a `vision_config` (`is_vision_config`), or a hub name of the Qwen-VL families
    ('Qwen/Qwen2.5-VL-3B-Instruct': `-VL-` in it)."""
    if name in VISION_BUILTINS:
        return True
    c = local_model_config(name)
    if c is not None:
        return is_vision_config(c)
    return bool(re.search(r"-VL(-|$)", name, re.IGNORECASE))


def num_experts(c: dict) -> int:
    """Routed experts per MoE layer from a config.json (Qwen2/3-MoE `num_experts`, Mixtral `num_local_experts`,
    DeepSeek `n_routed_experts`); 0 for a dense model."""
    return int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)


def _sparse_layers(c: dict, n_layers: int) -> int:
    """Decoder layers with a routed-expert MLP (Qwen2/3-MoE: `decoder_sparse_step`, `mlp_only_layers`;
    DeepSeek: the first `first_k_dense_replace` are dense)."""
    step, dense_only = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or [])
    first = c.get("first_k_dense_replace") or 0
    return sum(1 for i in range(n_layers) if i >= first and i not in dense_only and (i + 1) % step == 0)


def _shape_from_config(c: dict) -> ModelShape:
    h, n_layers, v, inter = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    head = c.get("head_dim") or h // heads
    q, kv = head * heads, head * kv_heads
    attn = 2 * h * q + 2 * h * kv + 2 * h
    if c.get("attention_bias") or c.get("model_type") == "qwen2":  # q/k/v biases
        attn += q + 2 * kv
    if c.get("model_type") in ("qwen3", "qwen3_moe", "gemma3"):  # q/k RMSNorm weights
        attn += 2 * head
    experts = num_experts(c)
    sparse = _sparse_layers(c, n_layers) if experts else 0
    moe_inter = c.get("moe_intermediate_size") or inter
    expert_params = sparse * experts * 3 * h * moe_inter
    shared = c.get("shared_expert_intermediate_size") or 0
    moe_rest = sparse * (h * experts + (3 * h * shared + h if shared else 0))  # router (+ shared expert and gate)
    emb = v * h * (1 if c.get("tie_word_embeddings") else 2)
    params = n_layers * attn + (n_layers - sparse) * 3 * h * inter + expert_params + moe_rest + emb + h
    return ModelShape(params, h, n_layers, kv, emb + h, expert_params=float(expert_params), experts=experts,
                      heads=heads, kv_heads=kv_heads, vocab=v)


def model_shape(name: str) -> ModelShape:
    """From a local config.json when there is one; otherwise from the size in the name ('7B') with typical
    Qwen2.5 shapes, the dense Qwen3 shape for names like 'Qwen3-8B', or the Qwen3 MoE shape for names like
    'Qwen3-30B-A3B'; the built-in tiny model is known."""
    c = local_model_config(name)
    if c is not None:
        return _shape_from_config(c)
    if name in ("builtin:tiny", "builtin:tiny-tools"):
        return ModelShape(90_944, 64, 2, 64, 8_768, vocab=68)  # untied: 2 x 68 x 64 + 64 root parameters
    if name == "builtin:tiny-moe":
        return _shape_from_config(TINY_MOE_CONFIG)
    moe = re.search(r"(\d+B-A\d+B)", name, re.IGNORECASE)
    if moe and moe.group(1).upper() in KNOWN_MOE_CONFIGS:
        return _shape_from_config(KNOWN_MOE_CONFIGS[moe.group(1).upper()])
    dense3 = re.search(r"qwen3-(\d+(?:\.\d+)?)B(?!-A)", name, re.IGNORECASE)
    if dense3 and float(dense3.group(1)) in QWEN3_DENSE:
        return _shape_from_config(qwen3_dense_config(float(dense3.group(1))))
    m = re.search(r"(\d+(?:\.\d+)?)B", name, re.IGNORECASE)
    billions = float(m.group(1)) if m else 1.0
    h, n_layers, kv, tied = KNOWN_SHAPES.get(
        billions, min(KNOWN_SHAPES.items(), key=lambda kv_: abs(kv_[0] - billions))[1])
    return ModelShape(billions * 1e9, h, n_layers, kv, QWEN_VOCAB * h * (1 if tied else 2) + h)
