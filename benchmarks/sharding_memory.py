"""Per-process peak memory of the training backends on a ~50M-parameter model: ddp vs fsdp2 vs DeepSpeed ZeRO-3.

Each backend runs in fresh `torchrun` processes (2 gloo ranks on CPU): load the policy through the backend, take
`--steps` AdamW steps on a fixed random batch, then report every rank's peak RSS (`getrusage`), the parameter
elements it holds and its weights + gradients + optimizer bytes, beside what `grpo plan` predicts for them.
The `fsdp2-accum4` rows take 4 micro-batches per step and report the most gradient bytes a rank holds after a
micro-batch (`fsdp2.gradient_bytes`: its `.grad` shards plus FSDP2's unsharded accumulation), by default
(reduce-scatter every micro-batch) and with `distributed.fsdp2.unsharded_grad_accumulation`, beside `grpo plan`'s
gradients row.

Run: `python -m benchmarks.sharding_memory [--size 50m] [--steps 2] [--backends ddp fsdp2 zero3 fsdp2-accum4 ...]
[--out NAME]`. Results: `benchmarks/results/NAME` (default `sharding_memory.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
from pathlib import Path

from benchmarks.compare import RESULTS_DIR, fmt_table, machine_info, run_each_backend, torchrun_two

BACKENDS = {
    "ddp": ["rollout.engine=vllm"],
    "fsdp2": ["distributed.backend=fsdp2", "rollout.engine=vllm"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm"],
    "fsdp2-accum4": ["distributed.backend=fsdp2", "rollout.engine=vllm"],
    "fsdp2-accum4-unsharded": ["distributed.backend=fsdp2", "rollout.engine=vllm",
                               "distributed.fsdp2.unsharded_grad_accumulation=true"],
}
MICRO_BATCHES = {"fsdp2-accum4": 4, "fsdp2-accum4-unsharded": 4}
"""Micro-batches of 4 sequences per rank and step (1 for the other rows)."""


def measure_gradients(backend) -> list[int]:
    """Wrap `backend.accumulation_context`: the gradient bytes this rank holds after each micro-batch's backward
    (None for DeepSpeed, which keeps gradients in its own buffers)."""
    from grpo_cli.train.backends.fsdp2 import gradient_bytes

    held, inner = [], backend.accumulation_context

    @contextlib.contextmanager
    def measured(*, last: bool):
        with inner(last=last):
            yield
        held.append(gradient_bytes(backend.module))

    if backend.name != "deepspeed":
        backend.accumulation_context = measured
    return held


def worker(ckpt: str, out_dir: str, steps: int, micro_batches: int, overrides: list[str]) -> None:
    """One rank: load through the backend, train `steps` steps on a fixed batch, print this rank's numbers."""
    import torch

    from grpo_cli.config.load import build_config
    from grpo_cli.config.model_shape import model_shape
    from grpo_cli.planner.plan import training_state_bytes
    from grpo_cli.runtime.dist import all_reduce_sum, init_from_env
    from grpo_cli.train.batch import TrainBatch
    from grpo_cli.train.policy import load_policy
    from grpo_cli.train.step import optimizer_step

    info = init_from_env(torch.device("cpu"), timeout_minutes=10)
    cfg = build_config(overrides=[f"model.name_or_path={ckpt}", f"distributed.num_processes={info.world_size}",
                                  "train.micro_batch_size=4", f"train.prompts_per_step={2 * micro_batches}",
                                  "train.generations_per_prompt=4", *overrides])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    held = measure_gradients(policy.backend)
    g = torch.Generator().manual_seed(0)
    rows, prompt, completion = 4 * micro_batches, 16, 16
    ids = torch.randint(6, policy.module.config.vocab_size, (rows, prompt + completion), generator=g)
    cmask = torch.ones(rows, completion)
    batch = TrainBatch(ids, torch.ones_like(ids), cmask, advantages=torch.randn(rows, generator=g),
                       sampler_logprobs=-torch.rand(rows, completion, generator=g))
    for _ in range(steps):
        num_items = all_reduce_sum(float(cmask.sum()), info)
        optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=rows * info.world_size)
    local, total = policy.backend.param_numel()
    plan = training_state_bytes(cfg, model_shape(ckpt).params)
    (Path(out_dir) / f"rank{info.rank}.json").write_text(json.dumps({
        "rank": info.rank, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_after_load_mb": after_load, "param_numel_local": local, "param_numel_total": total,
        "plan_state_mb": sum(plan.values()) / 2**20, "micro_batches": micro_batches,
        "peak_grad_mb": max(held) / 2**20 if held else None, "plan_grad_mb": plan["gradients"] / 2**20}))


def run_backend(ckpt: str, name: str, steps: int, out_dir: Path) -> list[dict]:
    torchrun_two("benchmarks.sharding_memory", [ckpt, str(out_dir), str(steps), str(MICRO_BATCHES.get(name, 1)),
                                                *BACKENDS[name]], label=name, timeout=1800)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="50m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--out", default="sharding_memory.json", help="results file name under benchmarks/results")
    args = ap.parse_args()
    params, results = run_each_backend(args.size, args.backends,
                                       lambda ckpt, name, folder: run_backend(ckpt, name, args.steps, folder))
    rows = [["backend", "micro-batches", "params held / total", "peak RSS rank 0 (MB)", "peak RSS rank 1 (MB)",
             "plan: weights+grads+optimizer per rank (MB)", "peak grads held per rank (MB)", "plan: grads (MB)"]]
    for name, ranks in results.items():
        r0 = ranks[0]
        grads = max(r["peak_grad_mb"] for r in ranks) if r0.get("peak_grad_mb") is not None else None
        rows.append([name, str(r0.get("micro_batches", 1)), f"{r0['param_numel_local'] / r0['param_numel_total']:.2f}",
                     *(f"{r['peak_rss_mb']:.0f}" for r in ranks), f"{r0['plan_state_mb']:.0f}",
                     "n/a" if grads is None else f"{grads:.1f}", f"{r0['plan_grad_mb']:.1f}"])
    print(f"{args.size} model ({params / 1e6:.1f}M parameters), 2 gloo processes, {args.steps} AdamW steps\n")
    print(fmt_table(rows))
    if {"fsdp2-accum4", "fsdp2-accum4-unsharded"} <= results.keys():
        ratio = max(r["peak_grad_mb"] for r in results["fsdp2-accum4"]) / max(
            r["peak_grad_mb"] for r in results["fsdp2-accum4-unsharded"])
        print(f"\nfsdp2, 4 micro-batches: default / unsharded_grad_accumulation gradient bytes per rank = {ratio:.3f}")
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / args.out
    out.write_text(json.dumps({"size": args.size, "params": params, "steps": args.steps, "results": results,
                               "machine": machine_info()}, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
