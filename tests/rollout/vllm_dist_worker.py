"""One torchrun worker of the 2-process colocate test (run by test_vllm_torchrun.py, not collected by pytest):
vLLM engine with the external launcher in each rank, generate, one DDP optimizer step, verified sync, generate."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.models.logprobs import completion_logprobs
from grpo_cli.rollout.vllm.engine import VLLMEngine
from grpo_cli.train.weights.weight_sync import sync_weights

PROMPTS = {0: [[3, 4, 6, 7, 5], [3, 4, 8, 5]], 1: [[3, 4, 9, 10, 11, 5], [3, 4, 12, 5], [3, 4, 13, 5]]}
PROBE = [[3, 4, 6, 7, 8, 5, 20, 21, 22, 23]]


def parity(model, batch, n: int) -> float:
    worst = 0.0
    for j, completion in enumerate(batch.completion_ids):
        ids = torch.tensor([batch.prompt_ids[j // n] + completion])
        lp = completion_logprobs(model, ids, torch.ones_like(ids), logits_to_keep=len(completion), temperature=1.0)
        worst = max(worst, max(abs(a - b) for a, b in zip(lp[0].tolist(), batch.sampler_logprobs[j], strict=True)))
    return worst


def main(checkpoint: str, tp: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engine = VLLMEngine(checkpoint, dtype="float32", tensor_parallel_size=tp, max_model_len=64, max_num_seqs=16,
                        seed=rank // tp, kv_cache_space_gib=1.0, distributed=True, eos_token_ids=[1])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    sampling = SamplingParams(n=2, max_tokens=8, seed=11)
    first = engine.generate(PROMPTS[rank], sampling)
    result = {"rank": rank, "tp": tp, "completions": len(first.completion_ids),
              "parity_before": parity(model, first, sampling.n)}

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ids = torch.tensor([PROMPTS[rank][0] + first.completion_ids[0]])
    loss = -completion_logprobs(ddp, ids, torch.ones_like(ids), logits_to_keep=ids.shape[1] - 1,
                                temperature=1.0).mean()
    loss.backward()
    opt.step()
    result["sync"] = sync_weights(engine, ddp, version=1, bucket_mb=1, verify=True, probe=PROBE)
    second = engine.generate(PROMPTS[rank], sampling)
    result.update(weight_version=second.weight_version, parity_after=parity(model, second, sampling.n))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
