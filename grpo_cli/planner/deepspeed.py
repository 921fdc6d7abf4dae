"""The DeepSpeed JSON a run uses, derived from the config alone (what `--dry-run` prints, what the deepspeed
backend hands to `zero.Init`/`deepspeed.initialize`, what `grpo plan` sizes buckets by)."""

from __future__ import annotations

import json

from grpo_cli.config.model_shape import model_shape
from grpo_cli.planner.plan import batch_plan, bucket_sizes
from grpo_cli.config.schema import GRPOConfig


def deepspeed_config(cfg: GRPOConfig) -> dict:
    """DeepSpeed JSON for `distributed.deepspeed`: what the deepspeed backend passes to `zero.Init` and
    `deepspeed.initialize` (and `--dry-run` prints). Batch sizes are the batch plan's (one optimizer step per
    `clip_and_step`); the optimizer is grpo-cli's torch AdamW (`zero_force_ds_cpu_optimizer: false` lets it step
    on the host under `offload_optimizer`); bf16/fp16 mode keeps float32 masters and skips steps whose gradient is
    not finite; gradients are reduced and accumulated as `reduce_dtypes` says."""
    ds, plan = cfg.distributed.deepspeed, batch_plan(cfg)
    zero: dict = {"stage": ds.zero_stage, "overlap_comm": ds.overlap_comm,
                  "contiguous_gradients": ds.contiguous_gradients}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    zero.update(bucket_sizes(model_shape(cfg.model.name_or_path).hidden, stage=ds.zero_stage))
    micro, accumulation = plan["micro_batch_size"], max(1, plan["gradient_accumulation"])
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16", "check_grad_overflow": True},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        **reduce_dtypes(cfg),
        "gradient_clipping": cfg.train.max_grad_norm or 0.0,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * plan["processes"],
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


DS_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""DeepSpeed's names of torch dtypes (`communication_data_type`, `data_types.*` accept fp32, bf16, fp16)."""


def reduce_dtypes(cfg: GRPOConfig) -> dict:
    """`communication_data_type` (the dtype of gradient all-reduce/reduce-scatter) and `data_types.grad_accum_dtype`
    (the dtype micro-batch gradients are summed in) from `distributed.reduce_dtype`, as fsdp2's
    `MixedPrecisionPolicy(reduce_dtype=...)` does. DeepSpeed's defaults are the model's dtype for both: a bf16 model
    reduced and summed 64 micro-batches in bf16 (8 significant bits). float32 (the default): both in fp32;
    bfloat16: communication in bf16 (half the traffic), the sum in fp32 over fp32 weights, else in the model's
    dtype."""
    d = cfg.distributed
    accumulate = "float32" if "float32" in (d.reduce_dtype, cfg.model.dtype) else cfg.model.dtype
    return {"communication_data_type": DS_DTYPE[d.reduce_dtype],
            "data_types": {"grad_accum_dtype": DS_DTYPE[accumulate]}}


def deepspeed_json(cfg: GRPOConfig) -> str:
    return json.dumps(deepspeed_config(cfg), indent=2)
