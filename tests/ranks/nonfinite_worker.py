"""Worker for test_ranks_nonfinite: one rank of a 2-process gloo job (process-group timeout 30 s, so a hang fails)
that trains STEPS steps of a fixed batch through the loop's `train_phase` under each backend of CASES, with
`GRPO_INJECT_FAULT=nonfinite_loss:rank=1:step=2`: rank 1's loss alone is NaN at step 2. Per case and step it records
the skip count, the rank-averaged metrics (`mean_metrics`, the all-gather where the unfixed code hung) and a digest
of the parameters this rank holds; the `ddp-stop` case (`train.on_nonfinite: stop`) records where each rank stopped.
Writes `OUT/rank{r}.json`.

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python nonfinite_worker.py CKPT CASES OUT`, CASES a
comma-separated list of keys of CASES."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

os.environ["GRPO_INJECT_FAULT"] = "nonfinite_loss:rank=1:step=2"
os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))  # DeepSpeed asks for it

from grpo_cli.config.load import build_config  # noqa: E402
from grpo_cli.runtime.dist import init_from_env, mean_metrics, shutdown  # noqa: E402
from grpo_cli.runtime.faults import FaultPlan  # noqa: E402
from grpo_cli.train.batch import TrainBatch  # noqa: E402
from grpo_cli.train.loop import LoopState, TrainingStopped, train_phase  # noqa: E402
from grpo_cli.train.policy import load_policy  # noqa: E402
from grpo_cli.train.supervise.timing import PhaseTimer  # noqa: E402

ROWS, P, T, STEPS = 4, 4, 6, 3
CASES = {
    "ddp": ["distributed.backend=ddp"],
    "fsdp2": ["distributed.backend=fsdp2"],
    "zero2": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=2"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3"],
    "megatron": ["distributed.backend=megatron"],
    "ddp-stop": ["distributed.backend=ddp", "train.on_nonfinite=stop"],
}


def config(ckpt: str, *overrides: str):
    return build_config(overrides=[
        f"model.name_or_path={ckpt}", "rollout.engine=vllm", "distributed.num_processes=2",
        "distributed.timeout_minutes=0.5", f"train.micro_batch_size={ROWS // 2}", "train.learning_rate=1e-2",
        "train.prompts_per_step=2", f"train.generations_per_prompt={ROWS}", f"rollout.max_completion_length={T}",
        f"train.steps={STEPS}", *overrides])


def batch_for(rank: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(6, vocab, (ROWS, P + T), generator=g)
    cmask = (torch.arange(T)[None, :] < torch.randint(2, T + 1, (ROWS,), generator=g)[:, None]).float()
    attn = torch.cat([torch.ones(ROWS, P, dtype=torch.long), cmask.long()], dim=1)
    return TrainBatch(ids, attn, cmask, advantages=torch.randn(ROWS, generator=g))


def local_digest(module: torch.nn.Module) -> str:
    """sha256 of the parameters this rank holds: fsdp2's local shards, ZeRO-3's partitions, whole tensors else."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
        h.update(name.encode() + t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_case(ckpt: str, case: str, info) -> dict:
    start = time.perf_counter()
    cfg = config(ckpt, *CASES[case])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    tr = SimpleNamespace(cfg=cfg, policy=policy, dist=info, timer=PhaseTimer(), faults=FaultPlan.from_env())
    vocab = policy.tokenizer.vocab_size
    state, steps, initial = LoopState(), [], local_digest(policy.backend.module)
    for _ in range(STEPS):
        try:
            out = train_phase(tr, state, batch_for(info.rank, vocab))
        except TrainingStopped as exc:
            return {"stopped_at": state.step + 1, "message": str(exc), "steps": steps}
        metrics = mean_metrics(out, info)
        steps.append({"skipped": state.skipped_steps, "metrics": sorted(metrics),
                      "skipped_metric": metrics["train/skipped_steps"], "digest": local_digest(policy.backend.module)})
        state.step += 1
    return {"steps": steps, "initial": initial, "seconds": time.perf_counter() - start}


def main(ckpt: str, cases: str, out: str) -> None:
    info = init_from_env(torch.device("cpu"), timeout_minutes=0.5)
    res = {case: run_case(ckpt, case, info) for case in cases.split(",")}
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(res))
    shutdown(info)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
