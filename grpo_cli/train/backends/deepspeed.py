"""`deepspeed`: ZeRO stage 1/2/3 through `deepspeed.initialize` with grpo-cli's torch AdamW and the JSON of
`planner.deepspeed.deepspeed_config`. ZeRO-3 builds the model under `zero.Init` and each rank reads only its own
partition (flat elements [r·n, (r+1)·n) of every tensor) from the safetensors files; bf16 runs keep fp32 masters."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from pathlib import Path

import torch

from grpo_cli.train.backends.activations import enable_checkpointing
from grpo_cli.train.backends.base import NonFiniteStep, TrainingBackend, compute_dtype, make_adamw, make_scheduler
from grpo_cli.train.backends.cpu_heap import SHARDED_THRESHOLD, return_large_frees_to_os
from grpo_cli.models.checkpoint_files import weight_files
from grpo_cli.train.backends.hf_io import check_names, load_hf_model, save_hf_folder
from grpo_cli.train.checkpoint import CheckpointError

TAG = "deepspeed"
"""Sub-folder of a checkpoint holding DeepSpeed's own files (model states, one optimizer partition per rank)."""


def ensure_process_group(device: torch.device, *, timeout_minutes: float) -> None:
    """DeepSpeed's comm layer on the job's process group (before `zero.Init` reads the world size); in one process
    a 1-rank group (`runtime.dist.ensure_process_group`), destroyed at the end of the job through `deepspeed.comm`,
    which also drops the subgroups DeepSpeed cached from it."""
    import deepspeed
    import deepspeed.comm
    import torch.distributed as dist

    from grpo_cli.runtime.dist import ensure_process_group, process_group_options

    if not dist.is_initialized():
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
            os.environ.setdefault(key, value)  # zero.Init reads LOCAL_RANK
    ensure_process_group(device, timeout_minutes=timeout_minutes, before_destroy=deepspeed.comm.destroy_process_group)
    opts = process_group_options(device, timeout_minutes=timeout_minutes)
    deepspeed.init_distributed(dist_backend=opts["backend"], timeout=opts["timeout"])


def partition_range(param) -> tuple[int, int]:
    """[start, stop) of the flattened tensor that this rank's ZeRO-3 partition holds (the tail is padding)."""
    import torch.distributed as dist

    size = param.ds_tensor.ds_numel
    start = size * dist.get_rank()
    return min(start, param.ds_numel), min(start + size, param.ds_numel)


@torch.no_grad()
def load_partitions(module: torch.nn.Module, folder: str) -> None:
    """Fill every ZeRO-3 partition from the safetensors files, reading only the rows that cover it."""
    from safetensors import safe_open

    files = weight_files(Path(folder))
    check_names(module, set(files), Path(folder))
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}
        for name, param in module.named_parameters():
            path = files[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            start, stop = partition_range(param)
            if start == stop:
                continue
            cols = math.prod(param.ds_shape[1:])
            first, last = start // cols, -(-stop // cols)
            flat = handles[path].get_slice(name)[first:last].reshape(-1)
            piece = flat[start - first * cols: stop - first * cols]
            param.ds_tensor[: stop - start].copy_(piece.to(param.ds_tensor.dtype))


def build_partitioned(cfg, model_path: str, *, ds_config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The model constructed under `zero.Init` (each module partitioned as it is built, weights not initialised)
    and loaded partition by partition: no rank ever holds the whole model."""
    import deepspeed
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    from grpo_cli.models.vision import causal_lm_class, freeze_vision

    config = AutoConfig.from_pretrained(model_path)
    # No `dtype=` to zero.Init: it takes the config's bf16/fp16/fp32 mode (= `dtype`), while an explicit dtype is
    # replaced by bfloat16 on the CPU accelerator (operator precedence in Init._set_dtype, DeepSpeed 0.19.8).
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_config):
        module = causal_lm_class(config).from_config(config, dtype=dtype,
                                                     attn_implementation=cfg.model.attn_implementation)
    module.tie_weights()  # built module by module under zero.Init, a tied head is a parameter of its own: tie again
    load_partitions(module, model_path)
    if cfg.model.freeze_vision:  # as `load_hf_model` does for ZeRO-1/2
        freeze_vision(module)
    return module


def reference_config(ds_config: dict) -> dict:
    """ZeRO-3 without an optimizer: the reference model partitioned like the policy, forward only."""
    zero = {k: v for k, v in ds_config["zero_optimization"].items() if k != "offload_optimizer"}
    keep = ("bf16", "fp16", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
            "steps_per_print", "wall_clock_breakdown")
    return {**{k: ds_config[k] for k in keep}, "zero_optimization": zero}


class DeepSpeedBackend(TrainingBackend):
    name = "deepspeed"

    def __init__(self, cfg, info, device) -> None:
        super().__init__(cfg, info, device)
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: no CUDA probe
        self.stage = cfg.distributed.deepspeed.zero_stage

    @property
    def shards_parameters(self) -> bool:  # type: ignore[override]
        return self.stage == 3

    def build(self, model_path: str) -> None:
        import deepspeed

        from grpo_cli.planner.deepspeed import deepspeed_config

        cfg = self.cfg
        if self.device.type == "cpu":
            return_large_frees_to_os(SHARDED_THRESHOLD)
        # DeepSpeed's own collectives use names torch deprecates; any filter change elsewhere (catch_warnings)
        # re-arms the warning, so unfiltered it repeats on every ZeRO gather (60 KB of output in 3 steps).
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)`"
                                r" is deprecated", category=FutureWarning)
        ensure_process_group(self.device, timeout_minutes=self.cfg.distributed.timeout_minutes)
        ds_config = deepspeed_config(cfg)
        dtype = compute_dtype(cfg)  # DeepSpeed keeps float32 masters of these weights in its ZeRO optimizer
        if self.stage == 3:
            module = build_partitioned(cfg, model_path, ds_config=ds_config, dtype=dtype)
        else:
            module = load_hf_model(cfg, model_path, dtype=dtype).to(self.device)
        enable_checkpointing(module, cfg.model.gradient_checkpointing)
        module.train()
        client = make_adamw(cfg, [p for p in module.parameters() if p.requires_grad])
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=client, config=ds_config)
        self.model, self.module = self.engine, self.engine.module
        self.scheduler = make_scheduler(cfg, client)  # stepped here, once per applied optimizer step
        if cfg.algorithm.kl.beta > 0:
            self.ref_model = self._reference(model_path, ds_config, dtype)
        self.load_teacher(lambda path: self._reference(path, ds_config, dtype))

    def _reference(self, model_path: str, ds_config: dict, dtype: torch.dtype) -> torch.nn.Module:
        import deepspeed

        if self.stage != 3:  # ZeRO-1/2 replicate the policy's weights too: a plain copy in the compute dtype
            return load_hf_model(self.cfg, model_path, dtype=dtype).to(self.device).eval().requires_grad_(False)
        config = reference_config(ds_config)
        ref = build_partitioned(self.cfg, model_path, ds_config=config, dtype=dtype).eval().requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=ref, config=config)
        engine.eval()  # DeepSpeedEngine.eval returns None
        return engine

    # ---- one optimizer step ------------------------------------------------------------------------------
    def accumulation_context(self, *, last: bool):
        """DeepSpeed reduces (and `step` updates) only at the boundary we set: the step's last micro-batch."""
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """`loss` × world size without DeepSpeed's 1/gradient_accumulation_steps: our loss is already scaled."""
        scale = self.info.world_size
        self.engine.backward(loss * scale if scale > 1 else loss, scale_wrt_gas=False)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def discard_step(self) -> None:
        """Every rank has back-propagated the step and a rank whose loss was not finite did so times NaN, so the
        reduced gradients hold a NaN on every rank: DeepSpeed's own step then finds the overflow collectively, clears
        every buffer it accumulated (ZeRO-1/2's partitions, ZeRO-3's) and applies nothing."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if norm is not None and math.isfinite(float(norm)):
            raise RuntimeError(f"DeepSpeed applied a step every rank agreed to skip (gradient norm {float(norm)})")

    def clip_and_step(self) -> float:
        """DeepSpeed computes the global norm, clips to `gradient_clipping` (= train.max_grad_norm) and skips the
        update (clearing gradients) when the norm is not finite; our schedule steps only on an applied update."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else math.nan
        if not math.isfinite(norm):
            raise NonFiniteStep(f"non-finite gradient norm {norm}")
        self.scheduler.step()
        return norm

    # ---- state ---------------------------------------------------------------------------------------------
    def param_numel(self) -> tuple[int, int]:
        """ZeRO-3: the elements of this rank's partitions (padding excluded); ZeRO-1/2 replicate parameters."""
        local = total = 0
        for p in self.module.parameters():
            if hasattr(p, "ds_tensor"):
                start, stop = partition_range(p)
                local, total = local + stop - start, total + p.ds_numel
            else:
                local, total = local + p.numel(), total + p.numel()
        return local, total

    def offloader(self):
        """`engine.offload_states` for the selected states. What `distributed.deepspeed.offload_*` already keeps
        in host memory is not moved again (DeepSpeed refuses to move offloaded parameters)."""
        from grpo_cli.train.weights.offload import FORCE_ENV, TrainingStateOffload

        off, ds = self.cfg.distributed.offload, self.cfg.distributed.deepspeed
        optimizer_state = off.optimizer and not ds.offload_optimizer
        params = off.params and not ds.offload_params
        if not (optimizer_state or off.grads or params):
            return None
        return TrainingStateOffload(self.engine, self.optimizer, optimizer_state=optimizer_state, grads=off.grads,
                                    params=params, force=os.environ.get(FORCE_ENV) == "1")

    def save_state(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder), tag=TAG, client_state={}, save_latest=False)

    def load_state(self, folder: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False, load_module_strict=True)
        if path is None:
            raise CheckpointError(f"{folder / TAG} holds no DeepSpeed checkpoint; resume from another checkpoint.")

    def export_hf(self, folder: Path, *, dtype: torch.dtype | None = None) -> None:
        """Rank 0 writes the gathered parameters: the module's (compute-dtype) weights bucket by bucket
        (`weight_sync.stream_named_tensors`), or DeepSpeed's float32 masters when float32 is asked of a 16-bit run."""
        dtype = dtype or compute_dtype(self.cfg)
        full: dict[str, torch.Tensor] = {}
        for name, tensor in self._full_tensors(masters=dtype == torch.float32 != compute_dtype(self.cfg)):
            if self.info.is_main:
                full[name] = tensor.to("cpu", copy=True)
        if self.info.is_main:
            buffers = {n for n, _ in self.module.named_buffers()}
            full.update({k: v for k, v in self.module.state_dict().items() if k in buffers})
            save_hf_folder(self.module, folder, state_dict=full, dtype=dtype)

    def _full_tensors(self, *, masters: bool):
        """(name, full tensor) of every parameter; collective."""
        if masters:
            from deepspeed.utils import safe_get_full_fp32_param

            for name, param in self.module.named_parameters():
                yield name, safe_get_full_fp32_param(param)
            return
        from grpo_cli.train.weights.hf_module import stream_named_tensors

        stats: dict = {"tensors": 0, "bytes": 0, "copies": {}}
        yield from stream_named_tensors(self.module, bucket_mb=self.cfg.distributed.weight_sync_bucket_mb,
                                        peft=False, stats=stats, keep_copies=set())
