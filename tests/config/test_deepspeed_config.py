"""`deepspeed_config`: every `distributed.deepspeed` field and the batch plan reach the JSON the backend builds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from dist_env import clean_env

from grpo_cli.config.load import build_config
from grpo_cli.planner.deepspeed import deepspeed_config


def _ds(*overrides: str) -> dict:
    return deepspeed_config(build_config(overrides=["distributed.backend=deepspeed", *overrides]))


def test_each_field_changes_the_config():
    base = _ds()["zero_optimization"]
    # builtin:tiny has hidden size 64: buckets of 64² elements (bucket_sizes)
    assert base == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 4096}
    assert _ds("distributed.deepspeed.zero_stage=1")["zero_optimization"]["stage"] == 1
    assert _ds("distributed.deepspeed.overlap_comm=false")["zero_optimization"]["overlap_comm"] is False
    assert _ds("distributed.deepspeed.contiguous_gradients=false")["zero_optimization"]["contiguous_gradients"] is False
    offload = _ds("distributed.deepspeed.offload_optimizer=true")["zero_optimization"]["offload_optimizer"]
    assert offload["device"] == "cpu"
    zero3 = _ds("distributed.deepspeed.zero_stage=3", "distributed.deepspeed.offload_params=true",
                "rollout.engine=vllm")["zero_optimization"]
    assert zero3["stage"] == 3 and zero3["offload_param"]["device"] == "cpu"
    assert (zero3["stage3_prefetch_bucket_size"], zero3["stage3_param_persistence_threshold"]) == (3686, 640)


def test_batch_sizes_precision_and_clipping_follow_the_config():
    ds = _ds("train.micro_batch_size=2", "train.max_grad_norm=0.5", "model.dtype=bfloat16")
    # default: 8 prompts x 8 generations on 1 process = 64 sequences, micro-batches of 2 -> 32 per step
    sizes = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]
    assert sizes == (2, 32, 64)
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["gradient_clipping"] == 0.5
    assert _ds("train.max_grad_norm=null")["gradient_clipping"] == 0.0


def test_gradients_are_reduced_and_accumulated_in_reduce_dtype():
    """`distributed.reduce_dtype` (float32 by default) sets DeepSpeed's communication and accumulation dtypes, which
    otherwise follow the model: a bf16 run reduced and summed its micro-batches in bf16."""
    bf16 = _ds("model.dtype=bfloat16", "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm")
    assert bf16["communication_data_type"] == "fp32" and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    halved = _ds("model.dtype=bfloat16", "distributed.reduce_dtype=bfloat16")
    assert halved["communication_data_type"] == "bf16" and halved["data_types"]["grad_accum_dtype"] == "bf16"
    fp32 = _ds("distributed.reduce_dtype=bfloat16")  # float32 weights: bf16 traffic, the sum stays in fp32
    assert fp32["communication_data_type"] == "bf16" and fp32["data_types"]["grad_accum_dtype"] == "fp32"


def test_zero3_bf16_step_runs_with_fp32_reduction(tiny_checkpoint):
    """DeepSpeed 0.19.8 accepts the keys: one ZeRO-3 bf16 step (2 micro-batches, 1 CPU process) with fp32
    communication and accumulation in effect."""
    worker = Path(__file__).with_name("ds_dtypes_worker.py")
    out = subprocess.run([sys.executable, str(worker), tiny_checkpoint], capture_output=True, text=True, timeout=300,
                         env=clean_env(OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    adopted = json.loads(out.stdout.strip().splitlines()[-1])
    assert adopted["communication"] == adopted["accumulation"] == "torch.float32", adopted
    assert math.isfinite(adopted["grad_norm"]) and adopted["grad_norm"] > 0
