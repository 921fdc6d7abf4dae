"""Hugging Face checkpoint I/O shared by the backends: load a model, read weights (whole or one rank's rows),
write a consolidated folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.train.checkpoint import CheckpointError


def load_hf_model(cfg: GRPOConfig, model_path: str, *, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                attn_implementation=cfg.model.attn_implementation)


def tied_names(module: torch.nn.Module) -> set[str]:
    """Parameter names that alias another parameter (e.g. `lm_head.weight` when embeddings are tied)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        else:
            seen[id(p)] = name
    declared = getattr(module, "_tied_weights_keys", None) or []
    return tied | set(declared if isinstance(declared, (list, set, tuple)) else declared.keys())


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name → safetensors file holding it (single file or an index of shards)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            out.update({k: f for k in handle.keys()})
    return out


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
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    module.save_pretrained(folder, state_dict=sd, safe_serialization=True)
    config = Path(folder) / "config.json"
    data = json.loads(config.read_text())
    data["dtype"] = str(dtype).removeprefix("torch.")
    config.write_text(json.dumps(data, indent=2))
