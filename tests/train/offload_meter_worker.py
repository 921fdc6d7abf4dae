"""Worker for test_offload_meter's DeepSpeed case (a fresh process: DeepSpeed leaves a process group and its
accelerator choice behind): ZeRO-3 + offload_optimizer, one process, the tiny model in float32, two optimizer steps,
then the backend's own offloader forced on CPU as `grpo train --rehearse` forces it.

Run: `offload_meter_worker.py CKPT OUT.json`. Writes the bytes each kind of training state holds (DeepSpeed's
buffers included), the bytes the offload moved, the reduce bucket's size and the `distributed.offload` flags the
offloader acted on.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from grpo_cli.config.load import build_config
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.weights.offload import FORCE_ENV
from grpo_cli.train.weights.offload_meter import held_bytes, snapshot
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step

ZERO3_CPU_OPTIMIZER = ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3",
                       "distributed.deepspeed.offload_optimizer=true", "distributed.offload.optimizer=true",
                       "distributed.offload.grads=true", "rollout.engine=vllm", "train.micro_batch_size=2",
                       "train.prompts_per_step=1", "train.generations_per_prompt=4"]


def main(ckpt: str, out: str) -> None:
    cfg = build_config(overrides=[f"model.name_or_path={ckpt}", *ZERO3_CPU_OPTIMIZER])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=DistInfo())
    g = torch.Generator().manual_seed(0)
    rows, prompt, completion = 4, 8, 8
    ids = torch.randint(6, policy.module.config.vocab_size, (rows, prompt + completion), generator=g)
    mask = torch.ones(rows, completion)
    batch = TrainBatch(ids, torch.ones_like(ids), mask, advantages=torch.randn(rows, generator=g),
                       sampler_logprobs=-torch.rand(rows, completion, generator=g))
    for _ in range(2):  # 2 micro-batches each: DeepSpeed's accumulation partitions in use
        optimizer_step(policy, batch, cfg, num_items=float(mask.sum()), num_sequences=rows)
    backend = policy.backend
    held = held_bytes(snapshot(backend.model, backend.optimizer))
    os.environ[FORCE_ENV] = "1"
    offloader = backend.offloader()
    offloader.offload()
    moved = dict(offloader.moved_bytes)
    offloader.reload()
    optimizer_step(policy, batch, cfg, num_items=float(mask.sum()), num_sequences=rows)  # still trains after it
    bucket = sum(b.buffer.numel() * b.buffer.element_size() for b in backend.optimizer.ipg_buckets.values()
                 if b.buffer is not None)
    grads_device = str(backend.optimizer.grad_partitions_flat_buffer.device)
    with open(out, "w") as f:
        json.dump({"held": held, "moved": moved, "bucket_bytes": bucket, "flags": offloader.flags,
                   "grad_partitions_device": grads_device}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
