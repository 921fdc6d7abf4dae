"""The policy a run trains: tokenizer plus the training backend that owns model, reference, optimizer and schedule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.backends import make_backend
from grpo_cli.train.backends.base import TrainingBackend
from grpo_cli.train.sequence_parallel import check_model


@dataclass
class Policy:
    """Everything the trainer updates or reads. `model` is what forward runs on (DDP/DeepSpeed wrapper or the
    FSDP2 root), `module` the Hugging Face model under it (possibly sharded; megatron: its chunks, so code that needs a
    Hugging Face model asks `backend.hf_module()`), `ref_model` None when β = 0."""

    backend: TrainingBackend
    tokenizer: object
    device: torch.device

    @property
    def model(self) -> torch.nn.Module:
        return self.backend.model

    @property
    def module(self) -> torch.nn.Module:
        return self.backend.module

    @property
    def ref_model(self) -> torch.nn.Module | None:
        return self.backend.ref_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.backend.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.backend.scheduler


def eos_token_ids(tokenizer, model) -> list[int]:
    """EOS ids from the generation config (which may list several) of `model`, or of the checkpoint folder it names
    (a str), plus the tokenizer's."""
    ids = getattr(_generation_config(model) if isinstance(model, str) else getattr(model, "generation_config", None),
                  "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _generation_config(model_path: str):
    """The checkpoint's `generation_config.json` (None without one)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(cfg: GRPOConfig, model_path: str, *, device: torch.device, info: DistInfo | None = None) -> Policy:
    """Build the backend named by `distributed.backend` (model, reference when β > 0, AdamW, schedule)."""
    torch.manual_seed(cfg.train.seed)
    backend = make_backend(cfg, info or DistInfo(), device)
    backend.build(model_path)
    check_model(backend.model, backend.sequence)
    return Policy(backend, load_tokenizer(model_path), device)
