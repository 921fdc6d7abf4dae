"""Worker for test_deepspeed_config: one process builds the ZeRO-3 bf16 policy from the generated config, takes one
optimizer step of 2 micro-batches on CPU and prints the dtypes DeepSpeed adopted as JSON.

Run as `python ds_dtypes_worker.py CKPT [OVERRIDE ...]`."""

from __future__ import annotations

import json
import sys

import torch

from grpo_cli.config.load import build_config
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step


def main(ckpt: str, *overrides: str) -> None:
    cfg = build_config(overrides=[f"model.name_or_path={ckpt}", "distributed.backend=deepspeed",
                                  "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm", "model.dtype=bfloat16",
                                  "train.micro_batch_size=2", "train.prompts_per_step=1",
                                  "train.generations_per_prompt=4", *overrides])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, policy.module.config.vocab_size, (4, 9), generator=g)
    cmask = torch.ones(4, 4)
    batch = TrainBatch(ids, torch.ones_like(ids), cmask, advantages=torch.randn(4, generator=g),
                       sampler_logprobs=-torch.rand(4, 4, generator=g))
    metrics = optimizer_step(policy, batch, cfg, num_items=float(cmask.sum()), num_sequences=4)
    engine = policy.backend.engine
    print(json.dumps({"communication": str(engine.communication_data_type),
                      "accumulation": str(engine.optimizer.gradient_accumulation_dtype),
                      "grad_norm": metrics["grad_norm"]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
