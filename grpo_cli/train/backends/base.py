"""The training-backend seam: one object owns building, backward, step, gathering, offload, save/load and export.

`train/step.py`, `train/loop.py` and `train/checkpoint.py` call these methods and never branch on the backend.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.runtime.dist import DistInfo

if TYPE_CHECKING:
    from grpo_cli.train.batch import TrainBatch

LossFn = Callable[["TrainBatch", torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(micro-batch, its completion logprobs (b, T), its entropy (b, T)) → (micro-batch loss, detached metrics)."""


class NonFiniteStep(Exception):
    """The loss or gradient was not finite; the optimizer step was skipped."""


def compute_dtype(cfg: GRPOConfig) -> torch.dtype:
    """`model.dtype`: the dtype of forward/backward compute."""
    return getattr(torch, cfg.model.dtype)


def master_dtype(cfg: GRPOConfig) -> torch.dtype:
    """Dtype of the trained weights and the AdamW state: float32 unless `model.master_weights: compute_dtype`.

    AdamW applied to bf16 weights rounds away every update below bf16's spacing (lr 1e-6, 5 steps: 0.95% of the
    parameters moved), so the default keeps float32 masters and casts for compute."""
    return torch.float32 if cfg.model.master_weights == "float32" else compute_dtype(cfg)


def lr_lambda(*, warmup_steps: int, total_steps: int, schedule: str):
    """Multiplier of the peak LR at optimizer step s: linear warm-up, then constant, linear or cosine decay."""

    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return fn


def fused_adam_ok(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel applies: plain floating-point tensors, all on CPU or one CUDA device.

    Fused is the same update as the default per-tensor loop in one kernel (10.7 → 4.3 ms per step for the 5M
    benchmark model on CPU); the default is kept for anything else (meta, XLA, DTensor shards)."""
    devices = {p.device for p in params}
    return (
        len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")
        and all(p.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64) for p in params)
        and not any(hasattr(p, "placements") for p in params)
    )


def make_adamw(cfg: GRPOConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (with `model.lora`: the adapter and `modules_to_save` only)."""
    t = cfg.train
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=t.adam_betas, weight_decay=t.weight_decay,
                             eps=t.adam_epsilon, fused=fused_adam_ok(params))


def make_scheduler(cfg: GRPOConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    t = cfg.train
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(warmup_steps=t.warmup_steps, total_steps=cfg.total_optimizer_steps,
                             schedule=t.lr_scheduler)
    )


def grad_norm_value(norm) -> float:
    """A float from `clip_grad_norm_`'s result (a DTensor under FSDP2)."""
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


class TrainingBackend:
    """What every backend provides. Subclasses set `model` (what forward runs on), `module` (the Hugging Face
    model, possibly sharded; megatron: its Megatron-core chunks), `ref_model`, `optimizer` and `scheduler` in
    `build`. Code outside the backends reaches the Hugging Face model through `hf_module()` and the weights an engine
    needs through `weight_source()`.

    Loss scaling: each micro-batch loss is scaled so that the sum over micro-batches and ranks is the step loss.
    Every backend here averages gradients over ranks, so `backward` runs loss × world_size to make that average
    the gradient of the sum."""

    name: ClassVar[str] = "base"
    shards_parameters: ClassVar[bool] = False
    """True when no rank holds the full model (fsdp2, ZeRO-3): the hf engine cannot share its weights."""

    def __init__(self, cfg: GRPOConfig, info: DistInfo, device: torch.device) -> None:
        self.cfg, self.info, self.device = cfg, info, device
        self.model: torch.nn.Module
        self.module: torch.nn.Module
        self.ref_model: torch.nn.Module | None = None
        self.teacher_model: torch.nn.Module | None = None
        """`algorithm.distill` with a local teacher: the frozen teacher, loaded like `ref_model` (`load_teacher`)."""
        self.optimizer: torch.optim.Optimizer
        self.scheduler: torch.optim.lr_scheduler.LambdaLR
        from grpo_cli.train.sequence_parallel import make_shard

        self.sequence = make_shard(cfg, info)
        """`distributed.sequence_parallel`: this rank's group (`models.sequence_attention.SequenceShard`), or None."""

    # ---- building ----------------------------------------------------------------------------------
    def build(self, model_path: str) -> None:
        raise NotImplementedError

    def hf_module(self) -> torch.nn.Module | None:
        """The Hugging Face model that holds the policy's weights (possibly sharded), which an hf engine may generate
        with; None when the backend trains another kind of model (megatron): the engine then loads its own copy."""
        return self.module

    def weight_source(self):
        """What a weight sync streams to the engine (`weights.source.WeightSource`): here the Hugging Face module's
        parameters (gathered from shards, LoRA merged, under checkpoint names), probed as the trainer computes."""
        from grpo_cli.train.weights.hf_module import ModuleWeights

        return ModuleWeights(self.module, compute_dtype=compute_dtype(self.cfg), compute_context=self.compute_context,
                             device=self.device)

    def reference(self):
        """Context yielding the model whose logprobs are the KL reference (β > 0): the frozen copy, or with
        `model.lora` the policy itself with its adapter disabled (no second copy in memory)."""
        if self.ref_model is not None:
            return contextlib.nullcontext(self.ref_model)
        return _adapter_disabled(self.module)

    def load_teacher(self, load: Callable[[str], torch.nn.Module]) -> None:
        """`algorithm.distill` with a local teacher: `teacher_model` = `load(folder)` (the backend's way of loading a
        frozen copy, the one its reference uses)."""
        from grpo_cli.train.distill import local_teacher

        if (path := local_teacher(self.cfg)) is not None:
            self.teacher_model = load(path)

    # ---- one optimizer step ------------------------------------------------------------------------
    @torch.no_grad()
    def batch_logprobs(self, batch: TrainBatch, *, micro_batch_size: int, temperature: float,
                       reference: bool = False, teacher: bool = False) -> torch.Tensor:
        """No-grad completion logprobs (B, T), fp32, of the whole batch under the policy, (`reference`) the KL
        reference or (`teacher`) the distillation teacher, micro-batch by micro-batch. Collective for backends that
        split the model across ranks."""
        from grpo_cli.train.batch import batch_logprobs

        chosen = (contextlib.nullcontext(self.teacher_model) if teacher else self.reference() if reference
                  else contextlib.nullcontext(self.model))
        with self.compute_context(), chosen as m:
            return batch_logprobs(m, batch, micro_batch_size=micro_batch_size, temperature=temperature,
                                  micro_batch_tokens=self.micro_batch_tokens(), agree=self.agree_count,
                                  any_images=self.image_agreement(), shard=self.sequence)

    def micro_batch_tokens(self) -> int | None:
        """`train.micro_batch_tokens`, the positions of a micro-batch per rank: a sequence-parallel group's
        micro-batch holds `size` times as many, one shard on each of its ranks."""
        tokens = self.cfg.train.micro_batch_tokens
        return tokens if tokens is None or self.sequence is None else tokens * self.sequence.size

    def agree_count(self, count: int) -> int:
        """The largest micro-batch count of any rank (one all-reduce): under `train.micro_batch_tokens` each rank
        cuts its own rows, and every rank must run as many micro-batches as the others (each forward may gather
        sharded weights, each backward reduce gradients)."""
        if self.info.world_size == 1:
            return count
        import torch.distributed as dist

        t = torch.tensor([count], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    @functools.cached_property
    def _agrees_images(self) -> bool:
        from grpo_cli.config.model_shape import is_vision_model

        return self.info.world_size > 1 and is_vision_model(self.cfg.model.name_or_path)

    def image_agreement(self) -> Callable[[bool], bool] | None:
        """`agree_images` for a vision-language model on several ranks (`train.batch.take` calls it for every
        micro-batch of every pass); None in one process or for a text-only model, decided from the config alike on
        every rank."""
        return self.agree_images if self._agrees_images else None

    def agree_images(self, has_images: bool) -> bool:
        """Whether any rank's micro-batch has an image (one all-reduce on the CPU group): a rank whose micro-batch
        has none then runs the vision tower on a zero-weight dummy image, because the tower's forward gathers
        sharded weights (fsdp2, ZeRO-3) and its backward reaches parameters a reducer waits for (ddp, ZeRO-2 with
        `model.freeze_vision: false`), on every rank or none."""
        import torch.distributed as dist

        t = torch.tensor([int(has_images)], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t)

    def forward_backward(self, batch: TrainBatch, *, micro_batch_size: int, temperature: float, entropy_grad: bool,
                         loss_fn: LossFn) -> list[dict[str, torch.Tensor]]:
        """Forward, `loss_fn` and backward of every micro-batch of `batch` (gradient reduction on the last); returns
        each micro-batch's metrics. Raises `NonFiniteStep` (gradients zeroed) on every rank when any rank's loss was
        not finite (`agree_finite`): each rank still back-propagates every micro-batch (a non-finite loss times NaN),
        so the ranks' gradient reductions stay paired. Backends that cannot run a micro-batch at a time (pipeline
        parallel) override the whole of it."""
        from grpo_cli.models.logprobs import packs_rows
        from grpo_cli.train.batch import forward_logprobs_entropy, micro_batch_rows, take

        tokens = self.micro_batch_tokens()
        groups = micro_batch_rows(batch, micro_batch_size=micro_batch_size, micro_batch_tokens=tokens,
                                  agree=self.agree_count, packed=packs_rows(self.model, batch.vision))
        out, nonfinite = [], None
        for k, rows in enumerate(groups):
            mb = take(batch, rows, micro_batch_tokens=tokens, any_images=self.image_agreement())
            with self.accumulation_context(last=k == len(groups) - 1):
                with self.compute_context():
                    logprobs, entropy = forward_logprobs_entropy(self.model, mb, temperature=temperature,
                                                                 entropy_grad=entropy_grad, shard=self.sequence)
                loss, metrics = loss_fn(mb, logprobs, entropy)
                if not torch.isfinite(loss):  # backward runs all the same: the other ranks' reductions wait for it
                    nonfinite = float(loss.detach()) if nonfinite is None else nonfinite
                    loss = loss * math.nan
                # a sequence-parallel group's ranks each hold the whole micro-batch loss (their parts summed with
                # autograd), so each back-propagates 1/size of it: the group's gradients sum to the loss's
                self.backward(loss if self.sequence is None else loss / self.sequence.size)
            out.append(metrics)
        self.agree_finite(nonfinite)
        return out

    def agree_finite(self, nonfinite: float | None) -> None:
        """Collective (one all-reduce on the CPU group): whether any rank's loss of this step was not finite
        (`nonfinite`: this rank's first such value, else None). If one was, every rank drops the step's gradients
        (`discard_step`) and raises `NonFiniteStep` naming the ranks, so all of them skip it together."""
        import torch.distributed as dist

        seen = torch.zeros(self.info.world_size, 2, dtype=torch.float64)  # per rank: (non-finite?, its loss)
        if nonfinite is not None:
            seen[self.info.rank] = torch.tensor([1.0, nonfinite])
        if self.info.world_size > 1:
            dist.all_reduce(seen)
        ranks = [r for r in range(self.info.world_size) if seen[r, 0] > 0]
        if ranks:
            self.discard_step()
            raise NonFiniteStep("non-finite loss " + ", ".join(f"{float(seen[r, 1])} on rank {r}" for r in ranks))

    def discard_step(self) -> None:
        """After every rank's backward of a step that is skipped: drop its gradients (all ranks call it)."""
        self.zero_grad()

    def compute_context(self):
        """Around every forward of the policy or reference (autocast where the backend does not cast itself)."""
        return contextlib.nullcontext()

    def accumulation_context(self, *, last: bool):
        """Around a micro-batch's forward+backward: gradient reduction only on the last one."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        scale = self.info.world_size
        (loss * scale if scale > 1 else loss).backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_and_step(self) -> float:
        """Clip the global gradient norm to `train.max_grad_norm`, step optimizer and schedule; returns the norm
        before clipping. Raises `NonFiniteStep` (gradients zeroed, no step) when it is not finite: on every rank
        together, since the norm is of the reduced gradients (ddp: the same on every rank; fsdp2: all-reduced)."""
        clip = self.cfg.train.max_grad_norm if self.cfg.train.max_grad_norm is not None else math.inf
        norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip))
        if not math.isfinite(norm):
            self.zero_grad()
            raise NonFiniteStep(f"non-finite gradient norm {norm}")
        self.optimizer.step()
        self.scheduler.step()
        return norm

    def learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # ---- state ---------------------------------------------------------------------------------------
    def param_numel(self) -> tuple[int, int]:
        """(elements of the policy's parameters this rank holds, elements of the whole model)."""
        local = total = 0
        for p in self.module.parameters():
            total += p.numel()
            local += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        return local, total

    def offloader(self):
        """The `distributed.offload` mover for this backend (None when nothing is selected)."""
        from grpo_cli.train.weights.offload import TrainingStateOffload

        return TrainingStateOffload.from_config(self.cfg.distributed.offload, self.model, self.optimizer)

    def save_state(self, folder: Path) -> None:
        """Collective: write weights + optimizer state (this rank's part) under `folder` (created by rank 0)."""
        raise NotImplementedError

    def load_state(self, folder: Path) -> None:
        """Collective: restore what `save_state` wrote."""
        raise NotImplementedError

    def export_hf(self, folder: Path, *, dtype: torch.dtype | None = None) -> None:
        """Collective: a consolidated Hugging Face folder written by rank 0, weights in `dtype` (default
        `model.dtype`; float32 gives the master weights exactly)."""
        raise NotImplementedError

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: full (unsharded) tensors of the trained parameters, on CPU (rank 0's copy is used)."""
        from grpo_cli.train.weights.lora import trainable_state

        return {n: t.cpu() for n, t in trainable_state(self.module).items()}

    def export_adapter(self, folder: Path) -> None:
        """Collective (`model.lora`): the adapter folder `PeftModel.from_pretrained` loads, written by rank 0."""
        state = self.trainable_state_dict()
        if self.info.is_main:
            self.module.save_pretrained(folder, state_dict=state, safe_serialization=True)

    def export_merged(self, folder: Path, *, dtype: torch.dtype | None = None) -> None:
        """Collective (`model.lora`): base + adapter merged into an ordinary Hugging Face folder (rank 0), the
        trained weights untouched."""
        from grpo_cli.train.weights.hf_module import stream_named_tensors

        stats: dict = {"tensors": 0, "bytes": 0, "copies": {}}
        merged = {n: t.cpu() for n, t in stream_named_tensors(
            self.module, bucket_mb=self.cfg.distributed.weight_sync_bucket_mb, peft=True, stats=stats,
            keep_copies=set())}
        if self.info.is_main:
            from grpo_cli.train.backends.hf_io import save_hf_folder

            base = self.module.get_base_model()
            save_hf_folder(base, folder, state_dict=merged, dtype=dtype or compute_dtype(self.cfg))


@contextlib.contextmanager
def _adapter_disabled(module: torch.nn.Module):
    with module.disable_adapter():
        yield module
