"""`fsdp2`: `fully_shard` on every decoder layer and the root; the model is built on the meta device and each
rank reads only its own rows of every tensor, so no rank ever holds the whole model (float32 masters, bf16
compute and `distributed.reduce_dtype` gradient reduction through `MixedPrecisionPolicy`; with
`distributed.fsdp2.cpu_offload`, FSDP2's `CPUOffloadPolicy` keeps the shards in host memory)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from grpo_cli.runtime.accel import is_cuda
from grpo_cli.config.hsdp import mesh_shape, vocab_parallel
from grpo_cli.runtime.dist import ensure_process_group
from grpo_cli.train.backends.base import TrainingBackend, compute_dtype, make_adamw, make_scheduler, master_dtype
from grpo_cli.train.backends.activations import enable_checkpointing
from grpo_cli.train.backends.cpu_heap import SHARDED_THRESHOLD, return_large_frees_to_os
from grpo_cli.models.checkpoint_files import weight_files
from grpo_cli.models.vision import freeze_vision
from grpo_cli.train.backends.hf_io import check_names, save_hf_folder
from grpo_cli.train.backends.hsdp import hsdp_mesh
from grpo_cli.train.checkpoint import CheckpointError
from grpo_cli.train.weights.lora import apply_lora, checkpoint_name, init_adapter
from grpo_cli.train.weights.shard_gather import local_rows

DCP_DIR = "dcp"


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: the classes the model lists as `_no_split_modules` (a vision-language
    model lists its vision blocks there too, Qwen2-VL's `Qwen2VLVisionBlock`: the vision tower is sharded block by
    block like the decoder)."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"{type(module).__name__} names no decoder layer class (_no_split_modules); fsdp2 "
                           "needs one to shard layer by layer.")
    return layers


def vocabulary_unit(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embedding and the output layer (once when tied: one parameter, two modules), as one `fully_shard`
    group: FSDP2 gathers their weights together when the model calls either (and keeps them, for a tied output layer
    that runs after the embedding), and the sequence-parallel forward, which calls neither, uses each rank's shard as
    its vocabulary rows (`models.vocab_parallel`)."""
    head = module.get_output_embeddings()
    return [module.get_input_embeddings()] + ([head] if isinstance(head, torch.nn.Module) else [])


def build_on_meta(cfg, model_path: str, *, dtype: torch.dtype) -> torch.nn.Module:
    """The model's structure with parameters on the meta device; buffers (rotary tables) real, on CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from grpo_cli.models.attention import attention_implementation
    from grpo_cli.models.vision import causal_lm_class

    config = AutoConfig.from_pretrained(model_path)
    with init_empty_weights(include_buffers=False):
        module = causal_lm_class(config).from_config(
            config, dtype=dtype, attn_implementation=attention_implementation(cfg.model.attn_implementation))
    module.tie_weights()  # init_empty_weights registers a separate meta tensor per module: tie them again
    return module


def materialize(module: torch.nn.Module, device: torch.device, *, params_on: torch.device | None = None) -> None:
    """Allocate the (sharded) parameters on `params_on` (default `device`; the host under `CPUOffloadPolicy`, which
    FSDP2 requires there) and the buffers on `device`, keeping the buffers' values computed at construction."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers(remove_duplicate=False)}
    module.to_empty(device=params_on or device)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = value.to(device)


@torch.no_grad()
def load_sharded(module: torch.nn.Module, folder: str, *, peft: bool = False) -> None:
    """Fill every DTensor parameter's local shard from the safetensors files, reading only this rank's rows (its
    coordinate in the mesh's shard dimension: under HSDP every replica reads the same rows). A PEFT model's base
    weights are read under their checkpoint names; its adapter is left to `init_adapter`."""
    from safetensors import safe_open

    files = weight_files(Path(folder))
    if not peft:
        check_names(module, set(files), Path(folder))
    handles: dict[Path, object] = {}
    with contextlib.ExitStack() as stack:
        for name, param in module.named_parameters():
            source = checkpoint_name(name) if peft else name
            if source is None:
                continue
            if source not in files:
                raise CheckpointError(f"{folder} has no tensor '{source}' (for the LoRA model's {name}); "
                                      "model.name_or_path must be the base model the adapter is trained on.")
            path = files[source]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            local = param.to_local() if hasattr(param, "to_local") else param.data
            start, stop = local_rows(param)
            rows = handles[path].get_slice(source)[start:stop]
            local.copy_(rows.to(local.dtype))


def fsdp_param_groups(module: torch.nn.Module):
    """FSDP2's parameter groups (`FSDPParamGroup`) of every `fully_shard`ed submodule. No public API lists them, and
    the private layout changed: torch 2.6-2.11 keep one group (None for a module without parameters of its own) in
    `FSDPState._fsdp_param_group`; 2.12+ a list `_fsdp_param_groups` (one group per mesh), beside a singular property
    that raises when there are several. Both are read here, the list first (pyproject.toml's torch floor is 2.6)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = state._fsdp_param_group
                groups = [] if group is None else [group]
            yield from groups


def _fsdp_params(module: torch.nn.Module):
    """FSDP2's per-parameter records (`FSDPParam`) of every `fully_shard`ed submodule."""
    for group in fsdp_param_groups(module):
        yield from group.fsdp_params


def gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of gradient this rank holds now: every parameter's `.grad` (its local shard under FSDP2) plus the
    unsharded gradients FSDP2 keeps between micro-batches that did not reduce-scatter."""
    def nbytes(t: torch.Tensor | None) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return 0 if t is None else t.numel() * t.element_size()

    held = sum(nbytes(p.grad) for p in module.parameters())
    for fsdp_param in _fsdp_params(module):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        held += nbytes(fsdp_param.unsharded_accumulated_grad) + nbytes(getattr(unsharded, "grad", None))
    return held


class FSDP2Backend(TrainingBackend):
    name = "fsdp2"
    shards_parameters = True

    def _policies(self) -> dict:
        """`fully_shard`'s keyword arguments: compute in `model.dtype`, reduce-scatter (and accumulate across
        micro-batches) in `distributed.reduce_dtype`; with `distributed.fsdp2.cpu_offload`, FSDP2's
        `CPUOffloadPolicy` (shards, gradients and optimizer state in host memory, pinned where a GPU copies them;
        the optimizer steps on the host: AdamW's plain loop, as for any DTensor, and the gradient norm's all-reduce
        runs on the CPU backend of the group); under HSDP, its 2-D mesh (`_mesh`)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        d = self.cfg.distributed
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype(self.cfg), reduce_dtype=getattr(torch, d.reduce_dtype))
        offload = CPUOffloadPolicy(pin_memory=is_cuda(self.device)) if d.fsdp2.cpu_offload else OffloadPolicy()
        return {"mp_policy": mp, "offload_policy": offload, "mesh": self._mesh}

    @functools.cached_property
    def _mesh(self):
        """HSDP's 2-D mesh under `distributed.fsdp2.replicate` > 1 (made once: the policy, reference and teacher share
        its groups), else None (`fully_shard`'s 1-D mesh over every process)."""
        replicas, shard = mesh_shape(self.cfg)
        if replicas == 1:
            return None
        return hsdp_mesh(self.device, replicas=replicas, shard=shard,
                         timeout_minutes=self.cfg.distributed.timeout_minutes)

    def _sharded(self, model_path: str, *, trainable: bool) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        cfg = self.cfg
        module = build_on_meta(cfg, model_path, dtype=master_dtype(cfg) if trainable else compute_dtype(cfg))
        if trainable:
            enable_checkpointing(module, cfg.model.gradient_checkpointing)
            if cfg.model.freeze_vision:  # before sharding: the frozen vision blocks' units then reduce no gradient
                freeze_vision(module)
        lora = trainable and cfg.model.lora is not None
        if lora:  # the adapter is added on meta too, then sharded with its layer
            module = apply_lora(cfg, module)
        policies = self._policies()
        for layer in decoder_layers(module):
            fully_shard(layer, **policies)
        if vocab_parallel(cfg):  # the sequence-parallel forward uses each rank's rows (models.vocab_parallel)
            fully_shard(vocabulary_unit(module), reshard_after_forward=False, **policies)
        fully_shard(module, **policies)
        materialize(module, self.device,
                    params_on=torch.device("cpu") if cfg.distributed.fsdp2.cpu_offload else self.device)
        load_sharded(module, model_path, peft=lora)
        if lora:
            init_adapter(module, seed=cfg.train.seed)
        return module.train() if trainable else module.eval().requires_grad_(False)

    def build(self, model_path: str) -> None:
        """In one process (no launcher), a 1-rank group for `fully_shard`'s mesh, destroyed at the end of the job."""
        cfg = self.cfg
        ensure_process_group(self.device, timeout_minutes=cfg.distributed.timeout_minutes)
        if self.device.type == "cpu":
            return_large_frees_to_os(SHARDED_THRESHOLD)
        self.module = self.model = self._sharded(model_path, trainable=True)
        if cfg.algorithm.kl.beta > 0 and cfg.model.lora is None:
            self.ref_model = self._sharded(model_path, trainable=False)
        self.load_teacher(lambda path: self._sharded(path, trainable=False))
        self.optimizer = make_adamw(cfg, list(self.module.parameters()))
        self.scheduler = make_scheduler(cfg, self.optimizer)

    def batch_logprobs(self, batch, **options) -> torch.Tensor:
        """`TrainingBackend.batch_logprobs`, then every model reshards its units: FSDP2 keeps a root's parameters
        (embedding, final norm, output layer) and the vocabulary unit's (`vocabulary_unit`, after a plain forward)
        unsharded after their forward for the backward that follows in training.
        A no-grad pass has none, and the KL reference and the teacher never run one: without this they held those
        matrices whole on every rank for the rest of the run (2.2 GB in bf16 for Qwen2.5-7B's untied 152K × 3,584
        pair). The training forward gathers the policy's again. Local: no collective."""
        from torch.distributed.fsdp import FSDPModule

        try:
            return super().batch_logprobs(batch, **options)
        finally:
            for model in (self.model, self.ref_model, self.teacher_model):
                for unit in () if model is None else model.modules():
                    if isinstance(unit, FSDPModule):  # the root, and the vocabulary unit (`vocabulary_unit`)
                        unit.reshard()

    def accumulation_context(self, *, last: bool):
        """Reduce-scatter every micro-batch's gradients at once (each rank keeps only its shard, accumulated in
        `distributed.reduce_dtype`), or with `distributed.fsdp2.unsharded_grad_accumulation` only the last one's:
        one reduce-scatter per step, but every rank holds the whole model's unsharded gradients until then."""
        self.module.set_requires_gradient_sync(last or not self.cfg.distributed.fsdp2.unsharded_grad_accumulation)
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        """Also drops the unsharded gradients FSDP2 accumulates between micro-batches without sync (a step abandoned
        mid-accumulation would otherwise add them to the next step's)."""
        super().zero_grad()
        for fsdp_param in _fsdp_params(self.module):
            fsdp_param.unsharded_accumulated_grad = None
            if getattr(fsdp_param, "_unsharded_param", None) is not None:
                fsdp_param._unsharded_param.grad = None

    def _options(self, **kw):
        """With LoRA the frozen base is not checkpointed (it is reloaded from `model.name_or_path`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.cfg.model.lora is not None, **kw)

    def _state_dicts(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.module, self.optimizer, options=self._options())

    def save_state(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = self._state_dicts()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / DCP_DIR))

    def load_state(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_sd, optim_sd = self._state_dicts()
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(folder / DCP_DIR))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self._options(strict=self.cfg.model.lora is None))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module, options=self._options(full_state_dict=True, cpu_offload=True))

    def export_hf(self, folder: Path, *, dtype: torch.dtype | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.info.is_main:
            save_hf_folder(self.module, folder, state_dict=full, dtype=dtype or compute_dtype(self.cfg))
