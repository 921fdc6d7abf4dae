"""Worker for test_chunked_backends (a fresh process per backend: DeepSpeed leaves a process group and its
accelerator choice behind): one process, the tiny model in float32 (tied Qwen2 or untied Llama), the policy built by
the backend (fsdp2: sharded output projection in the root group; deepspeed ZeRO-3: partitioned, gathered by its
hooks), then the completion logprobs, entropy and full gradients of one micro-batch through the chunked output layer
and through the full-logits path.

Run: `chunked_backends_worker.py CKPT BACKEND OUT` (writes `OUT/rank{r}.json`), alone or as 2 ranks (`WORLD_SIZE`
etc. set: ZeRO-3 then partitions every weight across both; each rank runs the same rows).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from grpo_cli.config.load import build_config
from grpo_cli.models import logprobs as scoring
from grpo_cli.models.logprobs import completion_logprobs_entropy
from grpo_cli.runtime.dist import init_from_env
from grpo_cli.train.policy import load_policy

BACKENDS = {
    "fsdp2": ["distributed.backend=fsdp2"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3"],
    "zero2": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=2"],
}
REPLACES = {"zero2"}
"""Without an optimizer step, ZeRO-2 replaces its gradient partitions at each accumulation boundary, while FSDP2 and
ZeRO-3 accumulate (ZeRO-3's `zero_grad` keeps its accumulated partitions): then the second pass's own gradient is
the difference."""
T = 10


def full_grad(param, *, deepspeed: bool) -> torch.Tensor:
    if deepspeed:  # ZeRO keeps the gradients in its own partitions
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param).detach().clone()
    grad = param.grad
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()


def one_pass(backend, ids, mask) -> dict:
    weights = torch.linspace(-1, 1, ids.shape[0] * T).view(-1, T)
    with backend.accumulation_context(last=True):
        with backend.compute_context():
            lp, h = completion_logprobs_entropy(backend.model, ids, mask, logits_to_keep=T, temperature=0.7,
                                                entropy_grad=True)
        backend.backward((lp * weights).sum() + 0.3 * (h * weights.flip(0)).sum())
    grads = {n: full_grad(p, deepspeed=backend.name == "deepspeed") for n, p in backend.module.named_parameters() if p.requires_grad}
    return {"logprobs": lp.detach(), "entropy": h.detach(), "grads": grads}


def main(ckpt: str, name: str, out: str) -> None:
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))  # DeepSpeed asks for it (one machine: the rank)
    info = init_from_env(torch.device("cpu"), timeout_minutes=1)
    cfg = build_config(overrides=[f"model.name_or_path={ckpt}", "rollout.engine=vllm", "algorithm.kl.beta=0.0",
                                  f"distributed.num_processes={info.world_size}", *BACKENDS[name]])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    backend = policy.backend
    vocab = backend.module.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, vocab, (6, 5 + T), generator=g)
    mask = torch.ones_like(ids)
    mask[:2, :2] = 0
    mask[3:, -3:] = 0
    rows = []  # 4 positions a chunk: several chunks per pass; the device the head asks for is recorded
    scoring.chunk_rows = lambda v, *, device: rows.append(device) or 4
    plain, real_weight = [], scoring._HeadStats._plain_weight
    scoring._HeadStats._plain_weight = lambda self: plain.append(real_weight(self) is not None) or real_weight(self)
    fast = one_pass(backend, ids, mask)
    scoring._HeadStats.install = classmethod(lambda cls, *a, **k: None)
    ref = one_pass(backend, ids, mask)
    if name not in REPLACES:
        ref["grads"] = {n: g - fast["grads"][n] for n, g in ref["grads"].items()}
    scale = {n: max(1.0, float(g.abs().max())) for n, g in ref["grads"].items()}
    report = {
        "chunk_devices": rows,
        "plain_weight": plain,
        "logprobs_diff": float((fast["logprobs"] - ref["logprobs"]).abs().max()),
        "entropy_diff": float((fast["entropy"] - ref["entropy"]).abs().max()),
        "grad_rel_diff": {n: float((fast["grads"][n] - g).abs().max()) / scale[n] for n, g in ref["grads"].items()},
        "grad_nonzero": {n: bool(g.abs().max() > 0) for n, g in ref["grads"].items()},
        "tied": backend.module.config.tie_word_embeddings,
    }
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()
