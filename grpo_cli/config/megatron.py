"""The `distributed.megatron:` section: Megatron-core parallelism (backend: megatron)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_cli.config.base import Section


class MegatronConfig(Section):
    """World = tensor_parallel × pipeline_parallel × context_parallel_size × data parallel (data parallel is what is
    left of `num_processes × num_machines`); expert parallel splits the MoE experts inside the data × tensor ranks."""

    tensor_parallel: int = Field(1, ge=1)
    """Ranks that split every layer's matrices (attention heads, MLP columns, the vocabulary); keep it within one
    machine. Must divide the attention heads, the key/value heads and the vocabulary padding."""
    pipeline_parallel: int = Field(1, ge=1)
    """Stages the decoder layers are cut into (the loss is computed on the last); must divide the layer count
    (× `virtual_pipeline`)."""
    expert_parallel: int = Field(1, ge=1)
    """Ranks that split a MoE layer's experts (1 for dense models); must divide the expert count and data
    parallel. A MoE model trains at `tensor_parallel` 1 (see `sequence_parallel`)."""
    virtual_pipeline: int | None = Field(None, ge=2)
    """Model chunks per pipeline stage (interleaved schedule: smaller bubble, more communication); needs
    `pipeline_parallel` > 1. None: one chunk per stage."""
    sequence_parallel: bool = False
    """Split layer norms and dropout along the sequence across the tensor-parallel ranks (less activation
    memory). Refused for now: the backend builds megatron-core's pure-torch layer spec, whose RMSNorm cannot do it
    (Transformer Engine's spec could; it is not built). Without it megatron-core also refuses a MoE model at
    `tensor_parallel` > 1: split experts with `expert_parallel` instead."""
    context_parallel_size: int = Field(1, ge=1)
    """Ranks that share one sequence (megatron-core's context parallelism: each holds 1/N of the positions, the
    attention passes key/value blocks around the group); world = tensor × pipeline × context × data. Modelled by
    `grpo plan` and `--rehearse`, but refused when training: megatron-core runs it only in Transformer Engine's
    attention (CUDA), and this backend builds the pure-torch layer spec (docs/megatron.md)."""
    distributed_optimizer: bool = True
    """Shard the float32 master weights and Adam state over the data-parallel ranks (ZeRO-1)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: `selective` recomputes the attention core only, `full` every layer's forward."""
