"""Worker for test_dp_parity: 3 optimizer steps on a fixed, replayed global batch; rank 0 saves the params.

Run as `[DP_WORKER_STEPS=3] python dp_worker.py CKPT OUT AGGREGATION [OVERRIDE ...]` (1 process) or under torchrun
(each rank trains its rows); overrides such as `distributed.backend=fsdp2` pick the training backend. Rank 0 saves
the consolidated parameters (gathered from shards by the backend's `export_hf`). `DP_WORKER_SKIP_NONFINITE=1` first
skips a step whose loss is NaN on the last rank; `DP_WORKER_RESUME_AT=k` writes a checkpoint after step k (train/checkpoint.py,
through the backend) and continues from it in a freshly built policy, rank 0 also saving the weights just before
the save and just after the load (OUT with suffixes .saved / .loaded).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from grpo_cli.config.load import build_config
from grpo_cli.runtime.accel import local_rank_from_env, resolve_device
from grpo_cli.runtime.dist import all_reduce_sum, init_from_env, shutdown
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import NonFiniteStep, batch_logprobs, optimizer_step

B, P, T = 16, 5, 7


def fixed_batch(vocab: int) -> TrainBatch:
    """Deterministic rollouts: prompts, completions of varying length, advantages, sampler logprobs."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(6, vocab, (B, P + T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    cmask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), cmask.long()], dim=1)
    adv = torch.randn(B, generator=g)
    sampler = -torch.rand(B, T, generator=g) * 3 * cmask
    return TrainBatch(ids, attn, cmask, advantages=adv, sampler_logprobs=sampler)


def held_bytes(policy) -> dict[str, int]:
    """Bytes of weights, gradients and AdamW state this rank holds (its shards only)."""

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(policy.module.parameters())
    states = [v for st in policy.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"weights": sum(size(p) for p in params), "gradients": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(v) for v in states)}


def export(policy, out: Path, info) -> None:
    """Rank 0 saves the consolidated float32 (master) weights at `out`."""
    folder = out.with_suffix(out.suffix + ".hf")
    policy.backend.export_hf(folder, dtype=torch.float32)
    if info.rank == 0:
        save_file({k: v.contiguous() for k, v in load_file(folder / "model.safetensors").items()}, out)


def skip_nonfinite_step(policy, batch: TrainBatch, cfg, info) -> None:
    """What a non-finite loss on the last rank leaves behind: a step that every rank back-propagates (that rank's
    gradients NaN, reduced into every rank's) and then skips together (`NonFiniteStep`, DeepSpeed's buffers dropped
    through its own overflow path). The next steps must not see any of it."""
    num_items = all_reduce_sum(float(batch.completion_mask.sum()), info)
    try:
        optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=B,
                       inject_nonfinite=info.rank == info.world_size - 1)
    except NonFiniteStep:
        return
    raise AssertionError("the step with a NaN loss on one rank was not skipped")


def save_and_reload(policy, cfg, ckpt: str, out: Path, info):
    """Checkpoint (collective), then a fresh policy restored from it: the round trip a resume takes."""
    from grpo_cli.train.checkpoint import load_checkpoint, save_checkpoint

    export(policy, out.with_suffix(".saved"), info)
    path = save_checkpoint(out.parent / "checkpoints", step=1, cfg=cfg, policy=policy, trainer_state={}, keep_last=1)
    fresh = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    load_checkpoint(path, cfg=cfg, policy=fresh)
    export(fresh, out.with_suffix(".loaded"), info)
    return fresh


def main(ckpt: str, out: str, aggregation: str, *overrides: str) -> None:
    device = resolve_device(os.environ.get("DP_WORKER_DEVICE", "cpu"), local_rank_from_env())  # tests/gpu: cuda
    info = init_from_env(device, timeout_minutes=10)
    steps = int(os.environ.get("DP_WORKER_STEPS", "3"))
    cfg = build_config(overrides=[f"model.name_or_path={ckpt}", f"algorithm.aggregation={aggregation}",
                                  "train.micro_batch_size=4", "train.learning_rate=1e-2",
                                  "train.prompts_per_step=2", "train.generations_per_prompt=8",
                                  f"distributed.num_processes={info.world_size}", *overrides])
    policy = load_policy(cfg, ckpt, device=device, info=info)
    full = fixed_batch(policy.module.config.vocab_size)
    per = B // info.world_size
    batch = full.rows(info.rank * per, (info.rank + 1) * per).to(device)
    if policy.ref_model is not None:  # β > 0: the reference (sharded like the policy) scores the batch
        with policy.backend.compute_context():
            batch.ref_logprobs = batch_logprobs(policy.ref_model, batch, micro_batch_size=4, temperature=1.0)
    if os.environ.get("DP_WORKER_SKIP_NONFINITE"):
        skip_nonfinite_step(policy, batch, cfg, info)
    resume_at = int(os.environ.get("DP_WORKER_RESUME_AT", "-1"))
    for step in range(steps):
        num_items = all_reduce_sum(float(batch.completion_mask.sum()), info)
        optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=B)
        if step + 1 == resume_at:
            policy = save_and_reload(policy, cfg, ckpt, Path(out), info)
    folder = Path(out).with_suffix(".hf")
    policy.backend.export_hf(folder, dtype=torch.float32)  # the master weights, exactly
    if info.rank == 0:
        weights = load_file(folder / "model.safetensors")
        save_file({k: v.contiguous() for k, v in weights.items()}, out)
        local, total = policy.backend.param_numel()
        Path(out).with_suffix(".json").write_text(json.dumps({"local": local, "total": total, **held_bytes(policy)}))
    shutdown(info)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
