"""Hugging Face ↔ Megatron-core weights through mbridge: the `GPTModel` config of an HF checkpoint, loading its
tensors into this rank's shards and exporting full HF-named tensors back. Fixes what mbridge 0.15.1 assumes:
`rope_theta` on the config (transformers 5 moved it into `rope_parameters`), Transformer Engine layers (we use the
pure-torch layer spec, whose norms are separate modules), a class-level name map that a tied model rewrites, and
MoE experts named only in Transformer Engine's grouped form (see `sequential_expert_names`)."""

from __future__ import annotations

import re

import torch

LOCAL_NORMS_ATTENTION = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
LOCAL_NORMS_MLP = {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]}
"""The pure-torch spec's norm modules and their HF names (the TE spec fuses them into `linear_qkv`/`linear_fc1`)."""


def hf_config(model_path: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "rope_theta", None) is None:
        rope = getattr(config, "rope_parameters", None) or {}
        config.rope_theta = rope.get("rope_theta", 10000.0)
    return config


def make_bridge(model_path: str, *, dtype: torch.dtype, vocab_multiple: int | None, overrides: dict):
    """The mbridge bridge of the checkpoint at `model_path`, with `overrides` on its `TransformerConfig`, the
    pure-torch layer spec and this instance's own weight-name maps."""
    config = hf_config(model_path)
    bridge_cls = _bridge_class(config)
    direct = dict(bridge_cls._DIRECT_MAPPING)  # __init__ may rewrite the class dict (tied embeddings); keep ours
    bridge = bridge_cls(config, dtype=dtype, make_vocab_size_divisible_by=vocab_multiple)
    bridge_cls._DIRECT_MAPPING.clear()
    bridge_cls._DIRECT_MAPPING.update(direct)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    bridge._DIRECT_MAPPING = {**direct, "output_layer.weight": "model.embed_tokens.weight" if tied else
                              "lm_head.weight"}
    bridge._OTHER_MAPPING = {**LOCAL_NORMS_ATTENTION, **bridge_cls._OTHER_MAPPING}
    bridge._MLP_MAPPING = {**LOCAL_NORMS_MLP, **bridge_cls._MLP_MAPPING}
    bridge._get_transformer_layer_spec = _local_spec(bridge)
    bridge._weight_name_mapping_mcore_local_to_global = sequential_expert_names(
        bridge, bridge._weight_name_mapping_mcore_local_to_global)
    bridge.set_extra_args(**overrides)
    return bridge


SEQUENTIAL_EXPERT = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
"""The pure-torch spec's expert weights (`SequentialMLP`: one MLP module per local expert)."""


def sequential_expert_names(bridge, mapping):
    """`mapping` (mbridge's local → global Megatron names of a model chunk) with `SequentialMLP`'s expert weights
    `…mlp.experts.local_experts.{e}.linear_fc{1,2}.weight` renamed to the grouped form mbridge converts,
    `…mlp.experts.linear_fc{1,2}.weight{g}`; g = e + ep_rank · experts per rank (with `consider_ep`), else e.
    mbridge 0.15.1 knows only the grouped names (Transformer Engine's `TEGroupedMLP`) and refuses the others."""

    def renamed(model, consider_ep: bool = True) -> dict[str, str]:
        out = mapping(model, consider_ep=consider_ep)
        experts = getattr(bridge.config, "num_moe_experts", None)
        offset = experts // bridge.mpu.ep_size * bridge.mpu.ep_rank if experts and consider_ep else 0
        for local, name in out.items():
            m = SEQUENTIAL_EXPERT.fullmatch(name)
            if m:
                out[local] = f"{m[1]}.{m[3]}.weight{int(m[2]) + offset}"
        return out

    return renamed


def _bridge_class(config):
    from mbridge.core.bridge import _MODEL_REGISTRY

    if config.model_type not in _MODEL_REGISTRY:
        raise ValueError(f"distributed.backend megatron: mbridge has no bridge for model type "
                         f"{config.model_type!r} (it has {sorted(_MODEL_REGISTRY)})")
    return _MODEL_REGISTRY[config.model_type]


def _local_spec(bridge):
    """The pure-torch (no Transformer Engine) decoder block spec of this pipeline stage's layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def spec(vp_stage: int | None = None):
        bridge.has_vp_stage = True
        return get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=False, vp_stage=vp_stage)

    return spec
