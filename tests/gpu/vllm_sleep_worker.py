"""Worker of test_gpu_vllm: colocated vLLM on one GPU through a sleep/sync/generate cycle; prints one JSON line.

`python vllm_sleep_worker.py CKPT LEVEL` (the model runner comes from VLLM_USE_V2_MODEL_RUNNER, read when the
engine starts, so each runner gets its own process). Measures free device memory (`torch.cuda.mem_get_info`) with
the engine awake and asleep, changes the policy, syncs it with verification (read-back + probe logprobs), and
generates again after the wake-up."""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.vllm.engine import VLLMEngine
from grpo_cli.train.weights.weight_sync import sync_weights

PROMPTS = [[3, 4, 6, 7, 8, 5], [3, 4, 9, 10, 5]]
SAMPLING = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=3)


def main(ckpt: str, level: str) -> None:
    engine = VLLMEngine(ckpt, dtype="bfloat16", max_model_len=128, gpu_memory_utilization=0.3,
                        sleep_level=int(level), eos_token_ids=[1])
    policy = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda()
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    first = engine.generate(PROMPTS, SAMPLING)  # the engine sleeps after generating (sleep_level > 0)
    torch.cuda.synchronize()
    free_asleep = torch.cuda.mem_get_info()[0]
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(0)
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda") * 1e-2)
    metrics = sync_weights(engine, policy, version=1, bucket_mb=64, verify=True, probe=PROMPTS)
    second = engine.generate(PROMPTS, SAMPLING)
    out = {"free_awake": free_awake, "free_asleep": free_asleep, "total": torch.cuda.mem_get_info()[1],
           "first": first.completion_ids, "second": second.completion_ids, "version": second.weight_version,
           "sync": {**engine.last_probe, **metrics}}  # asleep at the sync: the probe ran in `second`'s generate
    engine.close()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
