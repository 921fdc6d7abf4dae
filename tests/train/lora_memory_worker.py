"""Worker for test_lora_memory: build a policy (`CKPT OVERRIDE...`), run the reference and policy forward passes
and one optimizer step as the loop does, and print the resident memory that stays allocated (RSS after garbage
collection and `malloc_trim`, so transient load-time buffers do not count) and the peak, in MB, as JSON."""

from __future__ import annotations

import ctypes
import gc
import json
import resource
import sys

import psutil
import torch

from grpo_cli.config.load import build_config
from grpo_cli.train.policy import load_policy


def main(ckpt: str, *sets: str) -> None:
    cfg = build_config("tiny-cpu", overrides=[f"model.name_or_path={ckpt}", *sets])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"))
    ids = torch.randint(6, 60, (8, 48))
    if cfg.algorithm.kl.beta > 0:
        with policy.backend.reference() as ref, torch.no_grad():
            ref(input_ids=ids)
    loss = policy.model(input_ids=ids, labels=ids).loss
    policy.backend.backward(loss)
    policy.backend.clip_and_step()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    anon = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))
    print(json.dumps({"anon_rss_mb": anon / 1024, "rss_mb": psutil.Process().memory_info().rss / 2**20,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
