"""Hugging Face checkpoint I/O shared by the backends: load a model, read weights (whole or one rank's rows),
write a consolidated folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.models.weight_names import tied_aliases
from grpo_cli.train.checkpoint import CheckpointError


def load_hf_model(cfg: GRPOConfig, model_path: str, *, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's generating model (`models.vision.causal_lm_class`: a vision-language one too), its vision
    tower frozen with `model.freeze_vision`."""
    from transformers import AutoConfig

    from grpo_cli.models.attention import attention_implementation
    from grpo_cli.models.vision import causal_lm_class, freeze_vision

    config = AutoConfig.from_pretrained(model_path)
    model = causal_lm_class(config).from_pretrained(
        model_path, dtype=dtype, attn_implementation=attention_implementation(cfg.model.attn_implementation))
    if cfg.model.freeze_vision:
        freeze_vision(model)
    return model


def tied_names(module: torch.nn.Module) -> set[str]:
    """The further names of tied weights (e.g. `lm_head.weight` when embeddings are tied)."""
    return {name for names in tied_aliases(module).values() for name in names}


def check_names(module: torch.nn.Module, names: set[str], folder: Path) -> None:
    params = {n for n, _ in module.named_parameters()}
    missing = sorted(params - names - tied_names(module))
    unexpected = sorted(names - params - tied_names(module) - {n for n, _ in module.named_buffers()})
    if missing or unexpected:
        raise CheckpointError(f"{folder} does not match the model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}. Resume with the model the checkpoint was written for.")


def load_full_weights(module: torch.nn.Module, folder: Path) -> None:
    """Copy every tensor of the folder's safetensors into `module` (whole tensors, cast to each param's dtype)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(shard))
    check_names(module, set(weights), folder)
    module.load_state_dict(weights, strict=False)


def save_hf_folder(module: torch.nn.Module, folder: Path, *, state_dict: dict | None, dtype: torch.dtype) -> None:
    """`save_pretrained` with the weights cast to `dtype` (the compute dtype a user serves the model in)."""
    sd = module.state_dict() if state_dict is None else state_dict
    tied = tied_names(module)  # a gathered state dict holds tied weights twice, as separate tensors
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items() if k not in tied}
    module.save_pretrained(folder, state_dict=sd, safe_serialization=True)
    config = Path(folder) / "config.json"
    data = json.loads(config.read_text())
    data["dtype"] = str(dtype).removeprefix("torch.")
    config.write_text(json.dumps(data, indent=2))
