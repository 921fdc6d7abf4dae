"""The weights of a Hugging Face module (ddp, fsdp2, deepspeed; LoRA merged) as a weight-sync source: checkpoint
names of its parameters (tied ones under each name), full tensors gathered from ZeRO-3/FSDP shards in size-capped
buckets, probe logprobs from its own forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from grpo_cli.rollout.flat_weights import byte_buckets
from grpo_cli.models.logprobs import score_sequences
from grpo_cli.models.experts import expert_parts
from grpo_cli.models.weight_names import tied_aliases
from grpo_cli.train.weights.lora import lora_layer, merged_tensor
from grpo_cli.train.weights.shard_gather import GatheredBucket, row_sharded
from grpo_cli.train.weights.source import CHECKSUM_TENSORS, record_sent, spread

_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP/DeepSpeed engine wrappers (their parameter names carry a `module.` prefix)."""
    while type(model).__name__ in _WRAPPERS and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def is_peft(model) -> bool:
    return all(hasattr(model, a) for a in ("peft_config", "disable_adapter", "get_base_model"))


def is_zero3(param: torch.nn.Parameter) -> bool:
    """DeepSpeed ZeRO-3 partitions parameters and tags them with `ds_id`."""
    return hasattr(param, "ds_id")


def is_dtensor(tensor: torch.Tensor) -> bool:
    """FSDP2 (`fully_shard`) parameters are DTensors; `full_tensor()` all-gathers one."""
    return hasattr(tensor, "full_tensor") and hasattr(tensor, "placements")


def _is_fsdp1(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())


def hf_name(name: str, *, peft: bool) -> str | None:
    """Checkpoint name of a trainer parameter, or None when it is not a base-model weight (LoRA A/B, the
    frozen copy of a `modules_to_save` module)."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    if peft:
        if "lora_" in name or "original_module" in name:
            return None
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        name = name.replace("modules_to_save.default.", "")
    return name


def checkpoint_names(model: torch.nn.Module, *, peft: bool) -> dict[str, list[str]]:
    """{trainer parameter name, as `named_parameters()` lists it: every checkpoint name it stands for}, its own
    first, then its tied names (`weight_names.tied_aliases`: e.g. `lm_head.weight` for a tied
    `model.embed_tokens.weight`). Parameters that are not base-model weights (LoRA A/B) are left out."""
    aliases = tied_aliases(model)
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        own = hf_name(name, peft=peft)
        if own is not None:
            tied = (hf_name(a, peft=peft) for a in aliases.get(name, []))
            out[name] = list(dict.fromkeys([own, *(t for t in tied if t is not None)]))
    return out


def projection_names(model: torch.nn.Module, *, peft: bool) -> list[str]:
    """Checkpoint names of the input embedding's and the output projection's weights (each name of a tied one)."""
    names = checkpoint_names(model, peft=peft)
    wanted = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if isinstance(getattr(module, "weight", None), torch.Tensor):
            wanted.add(id(module.weight))
    return [c for n, p in model.named_parameters() if id(p) in wanted for c in names.get(n, [])]


def describe_ties(model: torch.nn.Module) -> str | None:
    """One line naming the tied weights a sync sends under several names, or None when there are none."""
    model = unwrap(model)
    tied = {k: v[1:] for k, v in checkpoint_names(model, peft=is_peft(model)).items() if len(v) > 1}
    if not tied:
        return None
    return "weight sync: tied weights, sent under each checkpoint name: " + "; ".join(
        f"{hf_name(k, peft=is_peft(model))} also as {', '.join(v)}" for k, v in tied.items())


def _full_numel(param: torch.nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


def buckets(named: list[tuple[str, torch.nn.Parameter]], cap_bytes: int) -> Iterator[list]:
    """Consecutive groups of parameters whose full (unsharded) size stays under `cap_bytes`; a single larger
    tensor is a bucket of its own. A bucket is gathered at once (ZeRO-3: `GatheredParameters`; FSDP2: one
    all-gather per dtype, `shard_gather`), so the cap bounds what a sync holds and sets how many collectives run."""
    return byte_buckets(named, cap_bytes, nbytes=lambda p: _full_numel(p) * p.element_size())


@contextlib.contextmanager
def _gathered(params: list[torch.nn.Parameter], *, dtype: torch.dtype | None = None,
              device: torch.device | None = None, exact: frozenset[int] = frozenset()):
    """Materialise a bucket (all ranks take part): ZeRO-3 partitions in place; FSDP2's row-sharded DTensors into
    one buffer per dtype (`shard_gather.GatheredBucket`, yielded; empty without any), cast to `dtype` and gathered
    on `device` (see there). Others pass through."""
    ds = [p for p in params if is_zero3(p)]
    rows = GatheredBucket([p for p in params if is_dtensor(p) and row_sharded(p)], dtype=dtype, device=device,
                          exact=exact)
    if not ds:
        yield rows
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(ds, modifier_rank=None):
        yield rows


def _full_tensor(param: torch.nn.Parameter, gathered: GatheredBucket) -> torch.Tensor:
    if param in gathered:
        return gathered.full(param)
    if is_dtensor(param):
        return param.full_tensor().detach()
    if is_zero3(param):
        return param.data.detach().clone()  # the gathered storage is released when the bucket's context exits
    return param.detach()


def stream_named_tensors(
    model: torch.nn.Module, *, bucket_mb: int, peft: bool, stats: dict, keep_copies: set[str],
    keep_rows: set[str] = frozenset(), dtype: torch.dtype | None = None, device: torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(checkpoint name, full tensor)` for every name of every base-model parameter (`checkpoint_names`:
    a tied weight once per name), gathering one bucket at a time; each recorded in `stats` (`source.record_sent`).
    FSDP2 shards are cast to `dtype` (the engine's) before their gather and gathered on `device` (the training
    device): a LoRA base weight is gathered in its own dtype, merged with its adapter, and cast after."""
    names = checkpoint_names(model, peft=peft)
    named = [(n, p) for n, p in model.named_parameters() if n in names]
    for bucket in buckets(named, bucket_mb * 2**20):
        exact = frozenset(id(p) for n, p in bucket if peft and lora_layer(model, n) is not None)
        with _gathered([p for _, p in bucket], dtype=dtype, device=device, exact=exact) as gathered:
            for name, param in bucket:
                tensor = _full_tensor(param, gathered)
                if peft:
                    tensor = merged_tensor(model, name, tensor)  # W + (α/r)·B·A, the trained tensors untouched
                for own in names[name]:
                    for out, part in expert_parts(own, tensor):  # fused MoE experts: per expert, as checkpoints
                        record_sent(stats, out, part, keep_copies=keep_copies, keep_rows=keep_rows)
                        yield out, part


@contextlib.contextmanager
def _sync_context(model: torch.nn.Module, *, peft: bool):
    """FSDP1 needs `summon_full_params` (the full model) while streaming. LoRA is never merged in place: each
    base weight is sent as W + scaling·B·A (`lora.merged_tensor`), so the trained tensors stay bit-exact."""
    with contextlib.ExitStack() as stack:
        if _is_fsdp1(model):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            stack.enter_context(FSDP.summon_full_params(model, writeback=False, rank0_only=False))
        yield


def checksum_names(model: torch.nn.Module, *, peft: bool, count: int = CHECKSUM_TENSORS) -> list[str]:
    """A few small 1-D weights (norms, biases), spread over the depth: cheap to read back exactly, and they
    change at every full-parameter optimizer step."""
    names = [hf_name(n, peft=peft) for n, p in model.named_parameters() if len(getattr(p, "ds_shape", p.shape)) == 1]
    return spread([n for n in names if n is not None], count)


def _trainer_logprobs(model: torch.nn.Module, probe: list[list[int]], vision=None) -> list[list[float]]:
    was_training = model.training
    model.eval()
    try:
        return score_sequences(model, probe, pad_token_id=0, **({} if vision is None else {"vision": vision}))
    finally:
        model.train(was_training)


class ModuleWeights:
    """`source.WeightSource` of a Hugging Face module (DDP/DeepSpeed wrappers removed; PEFT: LoRA merged on the way,
    the trained tensors untouched)."""

    def __init__(self, model: torch.nn.Module, *, compute_dtype: torch.dtype | None = None,
                 compute_context=contextlib.nullcontext, device: torch.device | None = None) -> None:
        """`compute_dtype` and `compute_context` (a backend's: autocast under ddp) say how the trainer's forward
        computes; a bare module computes in its weights' dtype, with no context. `device`: the training device,
        where FSDP2 shards are gathered (under `fsdp2.cpu_offload` they live on the host; None: where they are)."""
        self.device = device
        self.model = unwrap(model)
        self.peft = is_peft(self.model)
        self.dtype = next(self.model.parameters()).dtype
        self.compute_dtype = compute_dtype or self.dtype
        self._compute_context = compute_context

    def named_tensors(self, *, bucket_mb: int, stats: dict, keep_copies: set[str], keep_rows: set[str],
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        with _sync_context(self.model, peft=self.peft):
            yield from stream_named_tensors(self.model, bucket_mb=bucket_mb, peft=self.peft, stats=stats,
                                            keep_copies=keep_copies, keep_rows=keep_rows, dtype=dtype,
                                            device=self.device)

    def checksum_names(self) -> list[str]:
        return checksum_names(self.model, peft=self.peft)

    def projection_names(self) -> list[str]:
        return projection_names(self.model, peft=self.peft)

    def probe_logprobs(self, probe: list[list[int]], vision=None) -> list[list[float]]:
        """`vision`: the probe sequences' `models.vision.VisionInputs` (a vision-language model's probe)."""
        with self._compute_context():  # as the trainer computes: bf16 autocast over float32 masters under ddp
            return _trainer_logprobs(self.model, probe, vision)

    def describe_ties(self) -> str | None:
        return describe_ties(self.model)


def as_source(model):
    """A `WeightSource` as it is, a module wrapped in `ModuleWeights`."""
    return ModuleWeights(model) if isinstance(model, torch.nn.Module) else model
