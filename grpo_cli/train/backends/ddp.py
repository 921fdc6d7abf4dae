"""`ddp`: every rank holds the whole model (float32 masters), DistributedDataParallel averages gradients, and
bf16/fp16 compute comes from autocast."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from grpo_cli.train.backends.activations import enable_checkpointing
from grpo_cli.train.backends.base import TrainingBackend, compute_dtype, make_adamw, make_scheduler, master_dtype
from grpo_cli.train.backends.cpu_heap import VOCAB_THRESHOLD, return_large_frees_to_os
from grpo_cli.train.backends.hf_io import load_full_weights, load_hf_model, save_hf_folder
from grpo_cli.train.backends.cpu_linear import use_onednn_linear
from grpo_cli.train.weights.lora import apply_lora, is_peft, load_adapter


class DDPBackend(TrainingBackend):
    name = "ddp"

    def build(self, model_path: str) -> None:
        cfg = self.cfg
        self.module = load_hf_model(cfg, model_path, dtype=master_dtype(cfg)).to(self.device)
        enable_checkpointing(self.module, cfg.model.gradient_checkpointing)
        if cfg.model.lora is not None:
            self.module = apply_lora(cfg, self.module)
        self.module.train()
        if cfg.algorithm.kl.beta > 0 and cfg.model.lora is None:
            ref = load_hf_model(cfg, model_path, dtype=compute_dtype(cfg)).to(self.device)
            self.ref_model = ref.eval().requires_grad_(False)
        self.load_teacher(lambda path: load_hf_model(cfg, path, dtype=compute_dtype(cfg)).to(self.device)
                          .eval().requires_grad_(False))
        use_onednn_linear(cfg.model.cpu_linear, self.device, self.module, self.ref_model, self.teacher_model)
        self.model = self.module
        if self.device.type == "cpu":
            return_large_frees_to_os(VOCAB_THRESHOLD)
        if self.info.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # Gradients as views into DDP's reduce buckets: one copy of them per rank (what `grpo plan` counts),
            # not the gradients plus the buckets. Nothing here needs `.grad` to own its storage (offload parks a copy).
            self.model = DistributedDataParallel(self.module, gradient_as_bucket_view=True)
        self.optimizer = make_adamw(cfg, list(self.module.parameters()))
        self.scheduler = make_scheduler(cfg, self.optimizer)

    def agree_images(self, has_images: bool) -> bool:
        """Also True for every training micro-batch when the vision tower trains (`model.freeze_vision: false`):
        DDP's reducer (unused-parameter detection off) waits in the backward that syncs for a gradient of every
        trainable parameter, so a step whose last micro-batch has no image on any rank failed at the next forward
        ("Expected to have finished reduction in the prior iteration"); the zero-weight dummy image gives the
        tower's parameters their (zero) gradients."""
        agreed = super().agree_images(has_images)
        return agreed or (torch.is_grad_enabled() and self._tower_trains)

    @functools.cached_property
    def _tower_trains(self) -> bool:
        from grpo_cli.models.vision import is_vision_parameter

        return any(p.requires_grad for n, p in self.module.named_parameters() if is_vision_parameter(n))

    def compute_context(self):
        dtype = compute_dtype(self.cfg)
        if dtype == next(self.module.parameters()).dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def accumulation_context(self, *, last: bool):
        if last or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def save_state(self, folder: Path) -> None:
        if self.info.is_main:
            self.module.save_pretrained(folder, safe_serialization=True)
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")

    def load_state(self, folder: Path) -> None:
        if is_peft(self.module):  # the checkpoint holds the adapter; the frozen base comes from model.name_or_path
            load_adapter(self.module, folder)
        else:
            load_full_weights(self.module, folder)
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))

    def export_hf(self, folder: Path, *, dtype: torch.dtype | None = None) -> None:
        if self.info.is_main:
            save_hf_folder(self.module, folder, state_dict=None, dtype=dtype or compute_dtype(self.cfg))
