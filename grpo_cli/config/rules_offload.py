"""Cross-field rules of `distributed.offload` (training state moved to host memory while a colocated engine
generates): each refuses a combination where the offload would move nothing, crash, or move what generation needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_cli.config.sections import GRPOSections


def check_offload(cfg: GRPOSections) -> None:
    d = cfg.distributed
    if any(d.offload.model_dump().values()) and not cfg.rollout.colocated:
        raise ValueError(
            "distributed.offload moves training state off the device while a colocated engine generates; "
            f"with rollout.mode '{cfg.rollout.mode}' nothing shares the device, so turn the offload flags off."
        )
    if d.backend == "deepspeed" and d.deepspeed.zero_stage == 3 and d.offload.optimizer \
            and not d.deepspeed.offload_optimizer:
        raise ValueError(
            "distributed.offload.optimizer with ZeRO-3: DeepSpeed's offload_states moves ZeRO-3 optimizer state only "
            "for its CUDA FusedAdam, and grpo-cli steps torch AdamW. Set distributed.deepspeed.offload_optimizer=true "
            "(the optimizer state then stays in host memory, nothing to move) or distributed.offload.optimizer=false."
        )
    # DeepSpeed 0.19.8 (`DeepSpeedEngine._do_optimizer_sanity_check`) wraps the optimizer in BF16_Optimizer, which has
    # no offload_states, exactly for ZeRO-1 + bf16 + fp32 gradient accumulation (planner/deepspeed.reduce_dtypes: a
    # bf16 model with reduce_dtype float32) without a CPU offload_optimizer; ZeRO-2/3 and fp16 get its ZeRO optimizer.
    on = [k for k, v in d.offload.model_dump().items() if v]
    if d.backend == "deepspeed" and d.deepspeed.zero_stage == 1 and cfg.model.dtype == "bfloat16" \
            and d.reduce_dtype == "float32" and not d.deepspeed.offload_optimizer and on:
        raise ValueError(
            f"distributed.offload ({', '.join(on)}) cannot move the training state of DeepSpeed ZeRO-1 with "
            "model.dtype bfloat16 and distributed.reduce_dtype float32: DeepSpeed then steps through its "
            "BF16_Optimizer, which has no offload_states (the run would crash at the first generation). Use "
            "distributed.deepspeed.zero_stage=2 (the optimizer state stays partitioned as under ZeRO-1, the "
            "gradients too), or model.dtype=float32, or turn the distributed.offload flags off."
        )
    _check_offload_of_shared_weights(cfg)
    _check_offload_of_bucket_grads(cfg)


def _check_offload_of_shared_weights(cfg: GRPOSections) -> None:
    """The colocated hf engine generates with the policy's own parameters (`rollout/factory.make_hf_engine`: unless
    `rollout.dtype` asks for a copy in another dtype than the weights', or megatron leaves it none to share), so
    `distributed.offload.params` would move them to the host just before generation: generation ran on the CPU,
    silently. Refused on every device: on CPU the offload does nothing, and a config is rehearsed on CPU for a GPU."""
    d, r = cfg.distributed, cfg.rollout
    weights = "float32" if cfg.model.master_weights == "float32" else cfg.model.dtype
    shares = r.dtype in ("auto", weights) and d.backend != "megatron"
    if d.offload.params and r.layout.shares_policy_weights and shares:
        raise ValueError(
            "distributed.offload.params moves the policy's parameters to host memory while the engine generates, "
            "but rollout.engine 'hf' in colocate mode generates with those very parameters, so generation would run "
            "on the CPU. Set distributed.offload.params=false (distributed.offload.optimizer and .grads still free "
            "the GPU for generation), or use rollout.engine=vllm, which holds its own copy of the weights."
        )


def _check_offload_of_bucket_grads(cfg: GRPOSections) -> None:
    """Across processes ddp wraps the model with `gradient_as_bucket_view=True`: every `.grad` is a view into
    DistributedDataParallel's all-reduce buckets, which it keeps allocated for the whole run, so parking the
    gradients on the host frees no device memory (and the copy back doubled them until the next step)."""
    d = cfg.distributed
    if d.offload.grads and d.backend == "ddp" and d.num_processes * d.num_machines > 1:
        raise ValueError(
            "distributed.offload.grads frees no device memory with distributed.backend 'ddp' across processes: "
            "DDP's gradients are views into its all-reduce buckets, which it keeps allocated for the whole run (one "
            "copy of the gradients, counted by `grpo plan`). Set distributed.offload.grads=false "
            "(distributed.offload.optimizer still frees the AdamW state), or use distributed.backend=fsdp2 or "
            "deepspeed, whose gradient shards it does move."
        )
