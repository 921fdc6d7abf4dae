"""LoRA policies (`model.lora`, PEFT as it is): wrap the model, merged tensors for weight sync and export (computed
beside the trained ones: W + (alpha/r)·B·A, nothing merged in place), adapter save/load."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from grpo_cli.config.errors import UserError
from grpo_cli.config.schema import GRPOConfig

ADAPTER = "default"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def import_peft():
    try:
        import peft
    except ImportError:
        raise UserError("model.lora needs the peft package: pip install 'grpo-cli[lora]' (or set model.lora: null "
                        "to train every weight).") from None
    return peft


def is_peft(model) -> bool:
    return all(hasattr(model, a) for a in ("peft_config", "disable_adapter", "get_base_model"))


def apply_lora(cfg: GRPOConfig, module: torch.nn.Module) -> torch.nn.Module:
    """`module` wrapped by `peft.get_peft_model` per `model.lora`: only the adapter (and `modules_to_save`) trains."""
    peft = import_peft()
    lc = cfg.model.lora
    from grpo_cli.models.vision import VISION_MODULES, is_vision_config

    config = peft.LoraConfig(
        task_type="CAUSAL_LM", r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
        target_modules=lc.target_modules, modules_to_save=list(lc.modules_to_save) or None,
        exclude_modules=VISION_MODULES if is_vision_config(module.config) else None,  # the language model only
    )
    if cfg.model.gradient_checkpointing:  # checkpointed blocks need an input that requires grad (frozen embeddings)
        module.enable_input_require_grads()
    try:
        return peft.get_peft_model(module, config)
    except ValueError as exc:
        raise UserError(f"model.lora.target_modules: {exc}. Name modules of this model (e.g. [q_proj, v_proj]) "
                        "or use all-linear.") from None


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def lora_layer(model: torch.nn.Module, name: str):
    """The LoRA layer whose frozen base weight is parameter `name` (`….base_layer.weight`), else None."""
    if not name.endswith(".base_layer.weight"):
        return None
    layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
    return layer if ADAPTER in getattr(layer, "lora_A", {}) and not getattr(layer, "merged", False) else None


@torch.no_grad()
def merged_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The weight the merged model holds for parameter `name`: W + scaling·B·A for a LoRA base weight (float32
    arithmetic, W untouched), `tensor` itself otherwise. Collective for FSDP2 (A and B are all-gathered)."""
    layer = lora_layer(model, name)
    if layer is None:
        return tensor
    a, b = _full(layer.lora_A[ADAPTER].weight).float(), _full(layer.lora_B[ADAPTER].weight).float()
    delta = b @ a * layer.scaling[ADAPTER]
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return (tensor.float() + delta.to(tensor.device)).to(tensor.dtype)


@torch.no_grad()
def init_adapter(model: torch.nn.Module, *, seed: int) -> None:
    """PEFT's initialisation (A: kaiming-uniform(a=√5), B: 0) from a generator seeded by `train.seed`, written
    into this rank's rows of each (possibly `Shard(0)`, on a 1-D or HSDP mesh) adapter parameter: for models built
    on the meta device."""
    from grpo_cli.train.weights.shard_gather import local_rows

    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            continue
        full = torch.zeros(param.shape, dtype=torch.float32)
        if ".lora_A." in name:
            bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=√5) on a (r, in) matrix
            full.uniform_(-bound, bound, generator=gen)
        local = param.to_local() if hasattr(param, "to_local") else param.data
        start, stop = local_rows(param)
        local.copy_(full[start:stop].to(local.dtype))


def checkpoint_name(name: str) -> str | None:
    """The base checkpoint's name of a PEFT parameter (a frozen base weight, or either copy of a
    `modules_to_save` module, which both start from it); None for adapter matrices."""
    if "lora_" in name:
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    return name.replace(".original_module", "").replace(f".modules_to_save.{ADAPTER}", "")


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def load_adapter(module: torch.nn.Module, folder: Path) -> None:
    """Restore the adapter (and `modules_to_save`) weights written by `save_pretrained` into a PEFT model."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from grpo_cli.train.checkpoint import CheckpointError

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.exists():
        raise CheckpointError(f"{folder} holds no LoRA adapter ({ADAPTER_WEIGHTS}); it was written by a run "
                              "without model.lora. Resume with the config it was written with.")
    result = set_peft_model_state_dict(module, load_file(str(path)))
    if result.unexpected_keys:
        raise CheckpointError(f"{path} does not match model.lora (unexpected {result.unexpected_keys[:5]}); resume "
                              "with the LoRA settings it was written with.")


def load_merged(folder: str, *, dtype: torch.dtype, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A plain Hugging Face model from an adapter folder: its base (`base_model_name_or_path`) with the adapter
    merged in."""
    peft = import_peft()
    from transformers import AutoModelForCausalLM

    config = peft.PeftConfig.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, dtype=dtype,
                                                attn_implementation=attn_implementation)
    return peft.PeftModel.from_pretrained(base, folder).merge_and_unload()
