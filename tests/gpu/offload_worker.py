"""Worker for test_gpu_features' offload case (a fresh process: it opens a 1-rank process group): fsdp2 at world size
1 on DEVICE, one optimizer step, then `distributed.offload` (optimizer state, gradients, parameters) around a pretend
generation, measuring `torch.cuda.memory_allocated` before, offloaded and reloaded (forced on the CPU, where the
figures are 0), the bytes the meter says moved, and how many offloaded tensors still lie off the host.

Run: `offload_worker.py CKPT OUT.json DEVICE` with tests/ on PYTHONPATH (for `dist_env`)."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.distributed.tensor import DTensor

from dist_env import free_port
from grpo_cli.config.load import build_config
from grpo_cli.runtime.dist import DistInfo, init_process_group
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step
from grpo_cli.train.weights.offload import FORCE_ENV


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def on_device(offloader, policy) -> int:
    """Offloaded tensors (parameters, optimizer state) whose storage is not on the host."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in policy.backend.model.parameters()]
    local += [v.to_local() if isinstance(v, DTensor) else v for s in policy.backend.optimizer.state.values()
              for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return sum(t.device.type != "cpu" for t in local)


def main(ckpt: str, out: str, device_name: str) -> None:
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    init_process_group(device, timeout_minutes=10, world_size=1, rank=0,
                       init_method=f"tcp://127.0.0.1:{free_port()}")
    cfg = build_config(overrides=[
        f"model.name_or_path={ckpt}", "distributed.backend=fsdp2", "rollout.engine=vllm", "model.dtype=bfloat16",
        f"distributed.device={device_name}", "distributed.offload.optimizer=true", "distributed.offload.grads=true",
        "distributed.offload.params=true", "train.micro_batch_size=4", "train.prompts_per_step=1",
        "train.generations_per_prompt=4"])
    policy = load_policy(cfg, ckpt, device=device, info=DistInfo())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, policy.module.config.vocab_size, (4, 16), generator=g)  # 4 rows: 8 prompt + 8 completion
    mask = torch.ones(4, 8)
    batch = TrainBatch(ids, torch.ones_like(ids), mask, advantages=torch.randn(4, generator=g),
                       sampler_logprobs=-torch.rand(4, 8, generator=g)).to(device)  # as the loop does
    optimizer_step(policy, batch, cfg, num_items=float(mask.sum()), num_sequences=4)
    if device.type == "cpu":
        os.environ[FORCE_ENV] = "1"
    offloader = policy.backend.offloader()
    before = allocated(device)
    offloader.offload()
    result = {"allocated_before": before, "allocated_offloaded": allocated(device),
              "moved_bytes": sum(offloader.moved_bytes.values()), "off_device": on_device(offloader, policy)}
    offloader.reload()
    result["allocated_reloaded"] = allocated(device)
    optimizer_step(policy, batch, cfg, num_items=float(mask.sum()), num_sequences=4)  # still trains after it
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    import torch.distributed as dist

    dist.destroy_process_group()
