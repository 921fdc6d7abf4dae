"""`megatron`: Megatron-core `GPTModel` chunks built from the Hugging Face checkpoint through mbridge, split by
tensor, pipeline (optionally interleaved) and data parallelism (`distributed.megatron`), Megatron's DDP and optimizer
(float32 main weights, optionally sharded over data-parallel ranks), micro-batches through its pipeline schedule."""

from __future__ import annotations

import contextlib
import copy
import math
import shutil
from functools import partial
from pathlib import Path

import torch

from grpo_cli.train.backends.base import (
    LossFn,
    NonFiniteStep,
    TrainingBackend,
    compute_dtype,
)
from grpo_cli.train.backends.megatron import build, schedule
from grpo_cli.train.backends.megatron.batches import gather_group
from grpo_cli.train.backends.megatron.bridge import (
    hf_config,
    make_bridge,
)
from grpo_cli.train.batch import TrainBatch


def prepare_device(device: torch.device) -> None:
    """On the CPU, Megatron's CUDA assumptions need `cpu_shims` (imported only then); on every device, megatron-core
    without Transformer Engine needs `build.define_missing_te_names`."""
    build.define_missing_te_names()
    if device.type == "cpu":
        from grpo_cli.train.backends.megatron import cpu_shims

        cpu_shims.install()


def finalize_summed_grads(chunks, num_tokens=None, **kwargs) -> None:
    """Megatron's end-of-backward reduction (data-parallel ranks, tied embeddings across pipeline stages) without
    its division by the step's token count: `compute_loss` already scaled every micro-batch's loss."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(chunks, **kwargs)


class MegatronBackend(TrainingBackend):
    name = "megatron"
    shards_parameters = True

    # ---- building ----------------------------------------------------------------------------------
    def _bridge(self, model_path: str):
        tp = self.cfg.distributed.megatron.tensor_parallel
        self.vocab_size = hf_config(model_path).vocab_size
        return make_bridge(model_path, dtype=compute_dtype(self.cfg), vocab_multiple=tp if self.vocab_size % tp else
                           None, overrides=build.transformer_overrides(self.cfg))

    def build(self, model_path: str) -> None:
        from megatron.core import tensor_parallel

        cfg = self.cfg
        if cfg.model.lora is not None:
            raise NotImplementedError("distributed.backend megatron does not train LoRA adapters (model.lora); use "
                                      "ddp, fsdp2 or deepspeed.")
        prepare_device(self.device)
        self.model_path = model_path
        build.init_parallel_state(cfg, self.info.world_size, self.device)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
        self.bridge = self._bridge(model_path)
        self.chunks = build.wrap_ddp(cfg, self.bridge, build.build_chunks(self.bridge, self.device, trainable=True))
        self.bridge.load_weights(self.chunks, model_path)
        config = self.bridge.config
        config.finalize_model_grads_func = finalize_summed_grads
        no_sync = [c.no_sync for c in self.chunks]
        config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        self.model = self.module = torch.nn.ModuleList(self.chunks)
        self.ref_chunks: list[torch.nn.Module] | None = None
        if cfg.algorithm.kl.beta > 0:
            ref_bridge = self._bridge(model_path)
            self.ref_chunks = build.build_chunks(ref_bridge, self.device, trainable=False)
            ref_bridge.load_weights(self.ref_chunks, model_path)
            self.ref_model = torch.nn.ModuleList(self.ref_chunks)
        self.optimizer = build.make_optimizer(cfg, self.chunks)
        if compute_dtype(cfg) != torch.float32:  # Megatron keeps float32 masters in bf16/fp16 (as deepspeed)
            self._exact_masters(model_path)
        self.scheduler = build.MegatronSchedule(cfg, self.optimizer)

    def _exact_masters(self, model_path: str) -> None:
        """Float32 main weights equal to the checkpoint (not its bf16 rounding): load a float32 twin of this rank's
        chunks, copy it into the optimizer's masters, drop it."""
        twin_bridge = make_bridge(model_path, dtype=torch.float32, overrides=build.transformer_overrides(self.cfg),
                                  vocab_multiple=self.bridge.make_vocab_size_divisible_by)
        twin = build.build_chunks(twin_bridge, self.device, trainable=False)
        twin_bridge.load_weights(twin, model_path)
        build.keep_float32_masters(self.optimizer, self.chunks, twin)

    def reference(self):
        return contextlib.nullcontext(self.ref_model)

    # ---- one optimizer step ------------------------------------------------------------------------
    def _model_parallel_group(self):
        from megatron.core import parallel_state as mpu

        return mpu.get_model_parallel_group()

    @torch.no_grad()
    def batch_logprobs(self, batch: TrainBatch, *, micro_batch_size: int, temperature: float,
                       reference: bool = False) -> torch.Tensor:
        """Collective: the model-parallel group's rows through the schedule (forward only), this rank's back."""
        chunks = self.ref_chunks if reference else self.chunks
        merged, span = gather_group(batch, self._model_parallel_group())
        loss = partial(schedule.logprob_report, vocab_size=self.vocab_size, temperature=temperature)
        reports = schedule.from_last_stage(
            schedule.run_schedule(chunks, schedule.micro_batches(merged, micro_batch_size), loss, forward_only=True,
                                  head=dict(vocab_size=self.vocab_size, temperature=temperature, with_entropy=False,
                                            entropy_grad=False)))
        full = torch.cat([r["logprobs"] for r in reports])
        return full[span.start:span.stop, :span.width].to(batch.input_ids.device)

    def forward_backward(self, batch: TrainBatch, *, micro_batch_size: int, temperature: float, entropy_grad: bool,
                         loss_fn: LossFn) -> list[dict[str, float]]:
        """Collective: the model-parallel group's merged rows through the pipeline schedule, the loss on the last
        stage; gradients summed over data-parallel ranks by `finalize_model_grads`. Each rank reports `loss` as its
        share of the group's (the sum over ranks stays the step loss, as with the other backends). A non-finite loss
        on any rank's last stage skips the step on every rank (`agree_finite`), as in the other backends."""
        group = self._model_parallel_group()
        merged, _ = gather_group(batch, group)
        loss = partial(schedule.train_loss, vocab_size=self.vocab_size, temperature=temperature,
                       entropy_grad=entropy_grad, loss_fn=loss_fn)
        reports = schedule.from_last_stage(
            schedule.run_schedule(self.chunks, schedule.micro_batches(merged, micro_batch_size), loss,
                                  forward_only=False, head=dict(vocab_size=self.vocab_size, temperature=temperature,
                                                                with_entropy=True, entropy_grad=entropy_grad)))
        nonfinite = [value for r in reports if (value := r.pop("__nonfinite__")) is not None]
        self.agree_finite(nonfinite[0] if nonfinite else None)  # the schedule back-propagated every micro-batch
        share = torch.distributed.get_world_size(group)
        return [{k: (v / share if k == "loss" else v) for k, v in r.items()} for r in reports]

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError("the megatron backend back-propagates inside forward_backward (pipeline schedule)")

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def clip_and_step(self) -> float:
        """Megatron's optimizer step with the finiteness check between its norm and its update: gradients ready
        (float32 main grads), global norm over every model-parallel shard, clip to `train.max_grad_norm`, Adam."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        opt.prepare_grads()
        norm = float(opt.get_grad_norm())
        if not math.isfinite(norm):
            self.zero_grad()
            raise NonFiniteStep(f"non-finite gradient norm {norm}")
        clip = self.cfg.train.max_grad_norm
        if clip is not None:
            for part in getattr(opt, "chained_optimizers", [opt]):
                params = part.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=norm)
        opt.step_with_ready_grads()
        self.scheduler.step()
        return norm

    # ---- state ---------------------------------------------------------------------------------------
    def param_numel(self) -> tuple[int, int]:
        """(elements this rank holds, elements of the whole model: tensor-parallel shards counted on every rank,
        replicated tensors once per tensor-parallel group, a tied output layer's copy not at all; MoE expert weights
        (Megatron's `allreduce=False` parameters) summed over the expert tensor × expert × pipeline grid instead)."""
        from megatron.core import parallel_state as mpu

        local = 0
        owned = {"dense": 0, "expert": 0}
        first = {"dense": mpu.get_tensor_model_parallel_rank() == 0,
                 "expert": mpu.get_expert_tensor_parallel_rank() == 0}
        tied_copy = bool(getattr(self.bridge.hf_config, "tie_word_embeddings", False)) and not \
            mpu.is_pipeline_first_stage(ignore_virtual=True)
        for name, p in self.model.named_parameters():
            local += p.numel()
            if tied_copy and name.endswith("output_layer.weight"):
                continue
            kind = "dense" if getattr(p, "allreduce", True) else "expert"
            if getattr(p, "tensor_model_parallel", False) or first[kind]:
                owned[kind] += p.numel()
        total = 0
        for kind, group in (("dense", self._model_parallel_group()),
                            ("expert", mpu.get_expert_tensor_model_pipeline_parallel_group())):
            count = torch.tensor([owned[kind]], dtype=torch.float64)
            torch.distributed.all_reduce(count, group=group)
            total += int(count)
        return local, total

    def offloader(self):
        d = self.cfg.distributed.offload
        if d.optimizer or d.grads or d.params:
            raise NotImplementedError("distributed.offload is not implemented for distributed.backend megatron")

    def hf_tensor_buckets(self, *, bucket_mb: int | None = None, stats: dict | None = None):
        """Collective: (HF name, full tensor) lists, one per bucket of at most `bucket_mb` (default
        `distributed.weight_sync_bucket_mb`) of full tensors; the model's compute-dtype weights (float32 runs: the
        trained weights themselves)."""
        from grpo_cli.train.backends.megatron.export import hf_tensor_buckets

        cap = bucket_mb or self.cfg.distributed.weight_sync_bucket_mb
        return hf_tensor_buckets(self.bridge, self.chunks, bucket_mb=cap, stats=stats)

    def hf_module(self) -> None:
        """None: the policy is Megatron-core chunks, so an hf engine holds its own copy, synced from the buckets."""
        return None

    def weight_source(self):
        """`hf_tensor_buckets` as a weight-sync source, with probe logprobs from this backend's schedule."""
        from grpo_cli.train.backends.megatron.weights import MegatronWeights

        return MegatronWeights(self)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every weight as a full Hugging Face-named tensor on CPU, gathered bucket by bucket."""
        return {name: t.cpu() for bucket in self.hf_tensor_buckets() for name, t in bucket}

    def export_hf(self, folder: Path, *, dtype: torch.dtype | None = None) -> None:
        """Collective: a consolidated Hugging Face folder (config + safetensors) written by rank 0."""
        from safetensors.torch import save_file

        state = self.trainable_state_dict()
        if self.info.is_main:
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            dtype = dtype or compute_dtype(self.cfg)
            save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
                      metadata={"format": "pt"})
            config = copy.deepcopy(self.bridge.hf_config)
            config.dtype = dtype
            config.save_pretrained(folder)
            generation = Path(self.model_path) / "generation_config.json"
            if generation.exists():
                shutil.copyfile(generation, folder / "generation_config.json")

    def save_state(self, folder: Path) -> None:
        from grpo_cli.train.backends.megatron import state

        state.save(folder, self.chunks, self.optimizer)

    def load_state(self, folder: Path) -> None:
        from grpo_cli.train.backends.megatron import state

        state.load(folder, self.chunks, self.optimizer)
