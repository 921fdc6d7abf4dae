"""The exact accelerate/torchrun command a multi-process `grpo train` relaunches itself with."""

from __future__ import annotations

import json
import sys

from grpo_cli.config.schema import GRPOConfig


def deepspeed_config(cfg: GRPOConfig) -> dict:
    """DeepSpeed JSON for `distributed.deepspeed`: what the deepspeed backend passes to `zero.Init` and
    `deepspeed.initialize` (and `--dry-run` prints). Batch sizes are the batch plan's (one optimizer step per
    `clip_and_step`); the optimizer is grpo-cli's torch AdamW (`zero_force_ds_cpu_optimizer: false` lets it step
    on the host under `offload_optimizer`); bf16/fp16 mode keeps float32 masters and skips steps whose gradient is
    not finite; gradients are reduced and accumulated as `reduce_dtypes` says."""
    from grpo_cli.config.plan import batch_plan, model_shape

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


def bucket_sizes(hidden: int, *, stage: int) -> dict[str, int]:
    """Communication buckets sized by the model (the rule of Hugging Face's DeepSpeed integration): reduce
    hidden² elements at a time; under ZeRO-3 prefetch 0.9·hidden² and keep parameters under 10·hidden elements
    unpartitioned. DeepSpeed's fixed defaults (5e8-element reduce buckets) are sized for large models: on the 49M
    benchmark model they put ZeRO-3's peak above ddp's."""
    out = {"reduce_bucket_size": hidden * hidden}
    if stage == 3:
        out |= {"stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                "stage3_param_persistence_threshold": 10 * hidden}
    return out


def _worker_args(argv: list[str]) -> list[str]:
    """The user's `grpo ...` arguments, minus --dry-run, plus --worker."""
    args = [a for a in argv if a != "--dry-run"]
    return [*args, "--worker"]


def external_launch(env: dict[str, str]) -> list[str] | None:
    """Overrides matching a launcher that started this process (`accelerate launch -m grpo_cli ...` or
    `torchrun -m grpo_cli ...` by hand: WORLD_SIZE set), so the config's rules see the real process count and
    `grpo train` runs as a worker instead of launching again; None when no launcher is involved."""
    if "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    local = int(env.get("LOCAL_WORLD_SIZE", world))
    return [f"distributed.num_processes={local}", f"distributed.num_machines={max(1, world // local)}",
            f"distributed.machine_rank={int(env.get('GROUP_RANK', env.get('NODE_RANK', '0')))}",
            *([f"distributed.main_process_ip={env['MASTER_ADDR']}"] if world > local and "MASTER_ADDR" in env else [])]


def launch_command(cfg: GRPOConfig, argv: list[str]) -> list[str]:
    """[] for a single process; otherwise the accelerate or torchrun command running `python -m grpo_cli`."""
    d = cfg.distributed
    if d.num_processes * d.num_machines == 1:
        return []
    worker = ["-m", "grpo_cli", *_worker_args(argv)]
    if d.launcher == "torchrun":
        nodes = [f"--node_rank={d.machine_rank}", f"--master_addr={d.main_process_ip}"] if d.num_machines > 1 else []
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={d.num_processes}",
                f"--nnodes={d.num_machines}", *nodes, f"--master_port={d.main_process_port}", *worker]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes",
           str(d.num_processes * d.num_machines), "--num_machines", str(d.num_machines)]
    if d.num_machines > 1:
        cmd += ["--machine_rank", str(d.machine_rank), "--main_process_ip", str(d.main_process_ip)]
    cmd += ["--main_process_port", str(d.main_process_port)]
    # Every backend (ddp, fsdp2, deepspeed) is built inside the workers from the config (train/backends), so
    # accelerate only starts the processes: its `--multi_gpu` launcher (torchrun) works on CPU too, where the
    # workers join a gloo group; its `--cpu` would run ONE process.
    cmd.append("--multi_gpu")
    return [*cmd, *worker]


def deepspeed_json(cfg: GRPOConfig) -> str:
    return json.dumps(deepspeed_config(cfg), indent=2)
