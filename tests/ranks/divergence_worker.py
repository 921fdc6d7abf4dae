"""Worker for tests/ranks/test_ranks_divergence.py: one rank of a 2-process gloo job (1-minute collective timeout)
that feeds each rank different conditions and records, per case, what each rank saw. Each backend of BACKENDS is
built once and takes several optimizer steps on per-rank batches; after every case both ranks meet in `meet(name)`
(an object all-gather of the case's name), so a rank left behind in a collective is a timeout, not a hang.

Cases per backend: `masked` (rank 1's completions all empty: completion_mask 0, zero-length rows), `truncated`
(`algorithm.mask_truncated_completions`, every rank-1 row truncated), `budget` (`train.micro_batch_tokens`: rank 0's
short rows make fewer micro-batches than rank 1's long ones; also the old/ref no-grad pass), `budget_masked` (the same
budget with rank 1's rows all empty), each step's real metrics through `mean_metrics`. Once: `metrics` (a key and a
NaN on one rank only), `dynamic` (dynamic sampling with rank 0 full at once and rank 1 drawing two extra rounds),
`stop` (a stop signal seen by rank 0 only), `resume` (`checkpoint.resume: auto` finding a
checkpoint on rank 1's disk only), `teacher` (a served teacher refusing rank 1's request).

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python divergence_worker.py CKPT TEACHER BACKENDS
OUT`, TEACHER a `grpo serve-rollout` URL (max_model_len below rank 1's rows) or `-`, BACKENDS comma-separated keys of
BACKENDS."""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch

from grpo_cli.config.load import build_config
from grpo_cli.runtime.dist import DistInfo, all_gather_object, all_reduce_sum, init_from_env, mean_metrics, shutdown
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.loss import trained_mask
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step

BACKENDS = {
    "ddp": ["distributed.backend=ddp"],
    "fsdp2": ["distributed.backend=fsdp2"],
    "hsdp": ["distributed.backend=fsdp2", "distributed.fsdp2.replicate=2"],  # 2 replicas of 1: the all-reduce pairs
    "zero2": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=2"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3"],
    "megatron": ["distributed.backend=megatron"],
}
ROWS, P, T, BUDGET = 4, 4, 12, 40


def config(ckpt: str, backend: str, *overrides: str):
    return build_config(overrides=[
        f"model.name_or_path={ckpt}", *BACKENDS[backend], "rollout.engine=vllm", "distributed.num_processes=2",
        "distributed.timeout_minutes=1", f"train.micro_batch_size={ROWS // 2}", "train.learning_rate=1e-3",
        "train.prompts_per_step=2", f"train.generations_per_prompt={ROWS}", f"data.max_prompt_length={P}",
        f"rollout.max_completion_length={T}", "algorithm.kl.beta=0.05", *overrides])


def batch_for(rank: int, vocab: int, *, lengths: tuple[int, int], truncated: bool = False) -> TrainBatch:
    """ROWS rows of [P prompt tokens | completions of lengths in [low, high)]; (0, 1): every completion empty."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(6, vocab, (ROWS, P + T), generator=g)
    width = torch.randint(*lengths, (ROWS,), generator=g)
    cmask = (torch.arange(T)[None, :] < width[:, None]).float()
    attn = torch.cat([torch.ones(ROWS, P, dtype=torch.long), cmask.long()], dim=1)
    return TrainBatch(ids * attn, attn, cmask, advantages=torch.linspace(-1, 1, ROWS),
                      sampler_logprobs=-torch.rand(ROWS, T, generator=g) * cmask,
                      truncated=torch.full((ROWS,), truncated))


def meet(name: str, info: DistInfo) -> None:
    """Both ranks at the same case (a rank still inside the previous case's collectives times out here)."""
    names = all_gather_object(name, info)
    assert names == [name] * info.world_size, f"ranks at different cases: {names}"


def counted(backend) -> dict:
    """Count the micro-batches a step runs (each one's forward may gather shards, its backward reduce gradients)."""
    counts = {"run": 0}
    inner = backend.accumulation_context

    def wrapped(*, last: bool):
        counts["run"] += 1
        return inner(last=last)

    backend.accumulation_context = wrapped
    return counts


def step(policy, cfg, batch: TrainBatch, info: DistInfo) -> dict:
    """Old and reference logprobs (no-grad passes), then one optimizer step; this rank's view of it."""
    backend, temp = policy.backend, cfg.rollout.temperature
    counts = counted(backend)
    batch.old_logprobs = backend.batch_logprobs(batch, micro_batch_size=cfg.train.micro_batch_size, temperature=temp)
    batch.ref_logprobs = backend.batch_logprobs(batch, micro_batch_size=cfg.train.micro_batch_size, temperature=temp,
                                                reference=True)
    trained = trained_mask(batch.completion_mask, batch.truncated, algorithm=cfg.algorithm)
    num_items = all_reduce_sum(float(trained.sum()), info)
    out = optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=ROWS * info.world_size)
    del backend.accumulation_context  # the class's method again
    reduced = mean_metrics(out, info)
    return {"loss": out["loss"], "grad_norm": out["grad_norm"], "micro_batches": counts["run"],
            "finite": all(math.isfinite(v) for k, v in reduced.items() if k in ("loss", "grad_norm")),
            "keys": sorted(reduced)}


def backend_cases(ckpt: str, backend: str, info: DistInfo) -> dict:
    cfg = config(ckpt, backend)
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    vocab, r = policy.tokenizer.vocab_size, info.rank
    out: dict = {}
    mine = (0, 1) if r == 1 else (1, T + 1)
    out["masked"] = step(policy, cfg, batch_for(r, vocab, lengths=mine), info)
    meet(f"{backend}/masked", info)
    trunc = config(ckpt, backend, "algorithm.mask_truncated_completions=true")
    out["truncated"] = step(policy, trunc, batch_for(r, vocab, lengths=(1, T + 1), truncated=r == 1), info)
    meet(f"{backend}/truncated", info)
    if backend != "megatron":  # megatron's pipeline schedule keeps train.micro_batch_size
        built = policy.backend.cfg
        for case, lengths in (("budget", (1, 3) if r == 0 else (8, T + 1)), ("budget_masked", mine)):
            policy.backend.cfg = config(ckpt, backend, f"train.micro_batch_tokens={BUDGET}")
            out[case] = step(policy, policy.backend.cfg, batch_for(r, vocab, lengths=lengths), info)
            policy.backend.cfg = built
            meet(f"{backend}/{case}", info)
    return out


def once_cases(ckpt: str, teacher: str, info: DistInfo, out: str) -> dict:
    from once_cases import dynamic_case, metrics_case, resume_case, stop_case, teacher_case

    root, out = out, {"metrics": metrics_case(info)}
    meet("metrics", info)
    out["dynamic"] = dynamic_case(info)
    meet("dynamic", info)
    out["stop"] = stop_case(info)
    meet("stop", info)
    out["resume"] = resume_case(info, root)
    meet("resume", info)
    if teacher != "-":
        out["teacher"] = teacher_case(ckpt, teacher, info, config(ckpt, "ddp", f"algorithm.distill.teacher={teacher}"))
        meet("teacher", info)
    return out


def main(ckpt: str, teacher: str, backends: str, out: str) -> None:
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # DeepSpeed asks for it (one machine: the rank)
    info = init_from_env(torch.device("cpu"), timeout_minutes=1)
    report: dict = {}
    try:
        report["once"] = once_cases(ckpt, teacher, info, out)
        for backend in backends.split(","):
            report[backend] = backend_cases(ckpt, backend, info)
    except Exception:  # noqa: BLE001 - written for the test to show; the rank still fails
        report["error"] = traceback.format_exc()
        Path(out, f"rank{info.rank}.json").write_text(json.dumps(report))
        raise
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(report))
    shutdown(info)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
