"""Training backends (`distributed.backend`): ddp, fsdp2, deepspeed, megatron behind one seam
(`base.TrainingBackend`)."""

from __future__ import annotations

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.backends.base import TrainingBackend


def make_backend(cfg: GRPOConfig, info: DistInfo, device: torch.device) -> TrainingBackend:
    """The backend object named by `distributed.backend`; its library is imported only here."""
    name = cfg.distributed.backend
    if name == "fsdp2":
        from grpo_cli.train.backends.fsdp2 import FSDP2Backend

        return FSDP2Backend(cfg, info, device)
    if name == "deepspeed":
        from grpo_cli.train.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(cfg, info, device)
    if name == "megatron":
        from grpo_cli.train.backends.megatron.backend import MegatronBackend

        return MegatronBackend(cfg, info, device)
    from grpo_cli.train.backends.ddp import DDPBackend

    return DDPBackend(cfg, info, device)
