"""The train phase with micro-batches of `train.micro_batch_size` rows against `train.micro_batch_tokens` (issue 37,
item 2), on completions whose lengths vary 10×.

One fixed batch (seeded): P prompts × G completions, prompts of `--prompt-len` tokens, completion lengths drawn
uniformly from [T/10, T]. Each variant runs in a fresh subprocess (peak RSS from `getrusage`; on CUDA also
`torch.cuda.max_memory_allocated`) through the real ddp backend on one process: per step, the old-policy logprob
pass (`batch_logprobs`, as at μ > 1) and one `optimizer_step`; the first step is left out as warm-up. The budget is
`grpo plan`'s `same_memory_as_rows`: micro_batch_size × (prompt + T) positions, the most one micro-batch of rows can
hold padded (`--budget` sets another: where rows run packed, one micro-batch of a group's rows holds at most
prompt + micro_batch_size × T positions). Variants alternate (rows, tokens, rows, …) `--repeats` times; the table
gives medians.

Run: `python -m benchmarks.token_budget [--size 5m] [--arch mistral] [--budget N] [--steps 4] [--repeats 2]
[--device cpu]`.
Results: `benchmarks/results/token_budget.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.compare import (MARK, RESULTS_DIR, SIZES, build_checkpoint, fmt_table, machine_info, peak_rss_mb,
                                run_module_worker)

VARIANTS = ("rows", "tokens")


def make_batch(s: dict, vocab: int):
    """P·G rows of prompt `prompt_len` tokens (G rows share a prompt) and completions of T/10 to T tokens."""
    import torch

    from grpo_cli.rollout.base import RolloutBatch
    from grpo_cli.train.batch import build_batch

    g = torch.Generator().manual_seed(0)
    t, rows = s["completion_len"], s["prompts"] * s["generations"]
    lengths = torch.randint(max(1, t // 10), t + 1, (rows,), generator=g).tolist()
    rollout = RolloutBatch(
        prompt_ids=[torch.randint(6, vocab, (s["prompt_len"],), generator=g).tolist() for _ in range(s["prompts"])],
        completion_ids=[torch.randint(6, vocab, (n,), generator=g).tolist() for n in lengths],
        finish_reasons=["length" if n == t else "stop" for n in lengths])
    batch = build_batch(rollout, group_size=s["generations"], pad_token_id=0)
    batch.advantages = torch.randn(rows, generator=g)
    return batch


def worker(variant: str, s: dict) -> dict:
    import torch

    from grpo_cli.config.load import build_config
    from grpo_cli.train.policy import load_policy
    from grpo_cli.train.step import optimizer_step

    budget = s.get("budget") or s["micro_batch"] * (s["prompt_len"] + s["completion_len"])
    cfg = build_config(overrides=[
        f"model.name_or_path={s['checkpoint']}", f"distributed.device={s['device']}",
        f"train.prompts_per_step={s['prompts']}", f"train.generations_per_prompt={s['generations']}",
        f"train.micro_batch_size={s['micro_batch']}", f"data.max_prompt_length={s['prompt_len']}",
        f"rollout.max_completion_length={s['completion_len']}", "algorithm.num_iterations=2",
        *([f"train.micro_batch_tokens={budget}"] if variant == "tokens" else [])])
    device = torch.device(s["device"])
    policy = load_policy(cfg, s["checkpoint"], device=device)
    batch = make_batch(s, policy.module.config.vocab_size).to(device)
    backend, times = policy.backend, []
    num_items = float(batch.completion_mask.sum())
    for _ in range(s["steps"] + 1):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        batch.old_logprobs = backend.batch_logprobs(batch, micro_batch_size=s["micro_batch"], temperature=1.0)
        optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=len(batch))
        sync()
        times.append(time.perf_counter() - t0)
    res = {"train_s": times[1:], "budget": budget if variant == "tokens" else None, "peak_rss_mb": peak_rss_mb(),
           "padded_positions": len(batch) * batch.input_ids.shape[1],
           "real_positions": int(batch.attention_mask.sum())}
    if device.type == "cuda":
        res["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return res


def run_worker(variant: str, s: dict, timeout: float) -> dict:
    return run_module_worker("benchmarks.token_budget", variant, s, timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="5m", choices=sorted(SIZES))
    ap.add_argument("--arch", default=None, help="tiny architecture instead of the size's own (e.g. mistral: "
                    "sliding-window layers, whose rows never run packed)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--budget", type=int, default=None,
                    help="token budget (default: grpo plan's same_memory_as_rows, micro-batch x longest sequence)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "token_budget.json")
    args = ap.parse_args()
    if args.worker:
        print(MARK + json.dumps(worker(args.worker, json.loads(args.settings))), flush=True)
        return
    root = Path(os.environ.get("GRPO_BENCH_CACHE", "/tmp/grpo-bench"))
    checkpoint, params = build_checkpoint(args.size, root, arch=args.arch)
    s = {"checkpoint": checkpoint, "arch": args.arch, "device": args.device, "prompts": args.prompts,
         "generations": args.generations,
         "prompt_len": args.prompt_len, "completion_len": args.completion_len, "micro_batch": args.micro_batch,
         "steps": args.steps, "budget": args.budget}
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            res = run_worker(v, s, args.timeout)
            if "error" in res:
                sys.exit(f"{v}: {res['error']}")
            runs[v].append(res)
    med = {v: {"train_s": statistics.median(statistics.median(r["train_s"]) for r in runs[v]),
               "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs[v]),
               **({"peak_cuda_mb": statistics.median(r["peak_cuda_mb"] for r in runs[v])}
                  if args.device == "cuda" else {})} for v in VARIANTS}
    base = med["rows"]["train_s"]
    table = [["micro-batches", "train phase s (median)", "speed-up", "peak RSS MB"]
             + (["peak CUDA MB"] if args.device == "cuda" else [])]
    for v in VARIANTS:
        label = f"{args.micro_batch} rows" if v == "rows" else f"{runs[v][0]['budget']} tokens"
        table.append([label, f"{med[v]['train_s']:.3f}", f"{base / med[v]['train_s']:.2f}x",
                      f"{med[v]['peak_rss_mb']:.0f}"]
                     + ([f"{med[v]['peak_cuda_mb']:.0f}"] if args.device == "cuda" else []))
    name = f"{args.size}-{args.arch}" if args.arch else args.size
    print(f"# {name} ({params / 1e6:.1f}M params), {args.prompts} x {args.generations} rows, prompt "
          f"{args.prompt_len}, completions {max(1, args.completion_len // 10)}-{args.completion_len} tokens; "
          f"{runs['rows'][0]['real_positions']} of {runs['rows'][0]['padded_positions']} positions are tokens")
    print(fmt_table(table))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": s, "params": params, "machine": machine_info(), "median": med,
                                    "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
