"""Worker for test_token_budget_ranks: one rank of a 2-process gloo job that takes one optimizer step under ddp and
under fsdp2, with one micro-batch per rank and with `train.micro_batch_tokens`, where rank 0's completions are short
(few micro-batches of its own) and rank 1's long (many); writes each rank's micro-batch counts and the largest
difference between the two steps' reduced gradients to `OUT/rank{r}.json`.

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python token_budget_worker.py CKPT OUT`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from grpo_cli.config.load import build_config
from grpo_cli.models.logprobs import packs_rows
from grpo_cli.runtime.dist import all_reduce_sum, init_from_env, shutdown
from grpo_cli.train.batch import TrainBatch, micro_batch_rows
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step

ROWS, P, T, BUDGET = 8, 4, 24, 56


def config(ckpt: str, backend: str, *overrides: str):
    return build_config(overrides=[
        f"model.name_or_path={ckpt}", f"distributed.backend={backend}", "rollout.engine=vllm",
        "distributed.num_processes=2", f"train.micro_batch_size={ROWS}", "train.learning_rate=1e-2",
        "train.prompts_per_step=2", f"train.generations_per_prompt={ROWS}", "data.max_prompt_length=4",
        f"rollout.max_completion_length={T}", "algorithm.loss=dapo", *overrides])


def batch_for(rank: int, vocab: int) -> TrainBatch:
    """Rank 0: completions of 1-4 tokens; rank 1: 10-24 (lengths vary up to 24x over the step)."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(6, vocab, (ROWS, P + T), generator=g)
    low, high = (1, 5) if rank == 0 else (10, T + 1)
    cmask = (torch.arange(T)[None, :] < torch.randint(low, high, (ROWS,), generator=g)[:, None]).float()
    attn = torch.cat([torch.ones(ROWS, P, dtype=torch.long), cmask.long()], dim=1)
    return TrainBatch(ids, attn, cmask, advantages=torch.randn(ROWS, generator=g),
                      old_logprobs=-torch.rand(ROWS, T, generator=g) * cmask)


def full_grads(module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (fsdp2: gathered from the shards, a collective on every rank)."""
    return {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
            for n, p in module.named_parameters() if (g := p.grad) is not None}


def one_step(ckpt: str, backend: str, info, *overrides: str) -> tuple[dict[str, torch.Tensor], dict]:
    cfg = config(ckpt, backend, *overrides)
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    batch = batch_for(info.rank, policy.module.config.vocab_size)
    run = policy.backend
    counts = {"own": len(micro_batch_rows(batch, micro_batch_size=ROWS, micro_batch_tokens=cfg.train.micro_batch_tokens,
                                          packed=packs_rows(run.model, None))), "run": 0}
    inner = run.accumulation_context

    def counted(*, last: bool):
        counts["run"] += 1
        return inner(last=last)

    grads: dict[str, torch.Tensor] = {}
    step = run.clip_and_step

    def clip_and_step():
        grads.update(full_grads(policy.module))  # the step's reduced gradients, before clipping
        return step()

    run.accumulation_context, run.clip_and_step = counted, clip_and_step
    num_items = all_reduce_sum(float(batch.completion_mask.sum()), info)
    optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=2 * ROWS)
    return grads, counts


def main(ckpt: str, out: str) -> None:
    info = init_from_env(torch.device("cpu"), timeout_minutes=5)
    res = {}
    for backend in ("ddp", "fsdp2"):
        whole, whole_counts = one_step(ckpt, backend, info)
        budgeted, counts = one_step(ckpt, backend, info, f"train.micro_batch_tokens={BUDGET}")
        res[backend] = {"whole": whole_counts, "budget": counts, "grads": len(whole),
                        "max_diff": max(float((whole[k] - budgeted[k]).abs().max()) for k in whole)}
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(res))
    shutdown(info)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
