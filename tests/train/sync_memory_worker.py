"""Worker for test_sync_memory: under a sharded backend, stream the full weights for a sync in small buckets and
record how much the process's peak RSS grew, then gather the whole model at once for contrast.

Run under torchrun as `sync_memory_worker.py CKPT OUT BUCKET_MB OVERRIDE...`; rank 0 writes the numbers as JSON.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
from pathlib import Path

import torch

from grpo_cli.config.load import build_config
from grpo_cli.runtime.dist import init_from_env
from grpo_cli.train.policy import load_policy
from grpo_cli.train.weights.hf_module import stream_named_tensors


def rss_mb() -> float:
    """Resident memory now, after handing freed heap pages back to the OS (so it tracks live tensors)."""
    import psutil

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss / 2**20


def main(ckpt: str, out: str, bucket_mb: str, *overrides: str) -> None:
    info = init_from_env(torch.device("cpu"), timeout_minutes=10)
    cfg = build_config(overrides=[f"model.name_or_path={ckpt}", "rollout.engine=vllm",
                                  f"distributed.num_processes={info.world_size}", *overrides])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    model_mb = sum(p.numel() * p.element_size() for p in policy.module.parameters()) / 2**20
    before = rss_mb()
    stats = {"tensors": 0, "bytes": 0, "copies": {}}
    checksum, streamed = 0.0, 0.0
    for _, tensor in stream_named_tensors(policy.module, bucket_mb=int(bucket_mb), peft=False, stats=stats,
                                          keep_copies=set()):
        checksum += float(tensor.sum())
        streamed = max(streamed, rss_mb() - before)  # measured while the tensor is alive
        del tensor  # consumed and dropped, as an engine's loader does
    before_full = rss_mb()
    full = {n: t for n, t in stream_named_tensors(policy.module, bucket_mb=int(bucket_mb), peft=False,
                                                  stats={"tensors": 0, "bytes": 0, "copies": {}}, keep_copies=set())}
    held = rss_mb() - before_full
    if info.rank == 0:
        Path(out).write_text(json.dumps({"model_mb": model_mb, "streamed_growth_mb": streamed,
                                         "whole_model_growth_mb": held, "tensors": stats["tensors"],
                                         "sent_mb": stats["bytes"] / 2**20, "checksum": checksum,
                                         "held": len(full)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
