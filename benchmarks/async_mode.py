"""Async one-step-ahead rollouts against synchronous training, at equal settings.

Three variants of the same `grpo train` run (same checkpoint, prompts, G, completion length, micro-batch, steps,
seed), each a fresh `grpo train` subprocess, alternated A B C A B C:
  sync        rollout.mode=colocate, hf engine on the policy itself (the default pipeline)
  async s=1   rollout.mode=async, one Ray hf actor (1 core) generates step k+1 while the trainer trains step k
  async s=0   the same actor, but no batch ahead (rollout.max_staleness=0): isolates what the overlap buys
The settings are chosen so generation and training take similar time (the case async mode is for), and the
learning rate is small so the work per step (completion lengths) stays alike across steps and variants. Reports the
median over runs of each run's median seconds/step (the first `--skip` steps excluded: start-up and the first,
exposed generation), the phases the trainer sees, the actor's own generation time, and the ratios.

Run: `python -m benchmarks.async_mode [--size 5m|tiny] [--steps N] [--repeats N]`.
Results: `benchmarks/results/async_mode.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.compare import RESULTS_DIR, build_checkpoint, fmt_table, machine_info

VARIANTS = {
    "sync": ["--preset", "tiny-cpu"],
    "async s=1": ["--preset", "tiny-cpu-async", "--set", "rollout.max_staleness=1"],
    "async s=0": ["--preset", "tiny-cpu-async", "--set", "rollout.max_staleness=0"],
}


def run_variant(name: str, s: dict, timeout: float) -> dict:
    """One `grpo train` subprocess; per-step metrics from its metrics.jsonl."""
    out = Path(tempfile.mkdtemp(prefix="bench-async-"))
    cmd = [sys.executable, "-m", "grpo_cli", "train", *VARIANTS[name], "--output-dir", str(out / "run"),
           "--set", f"model.name_or_path={s['ckpt']}", "--set", f"train.steps={s['steps']}",
           "--set", f"train.prompts_per_step={s['prompts']}", "--set", f"train.generations_per_prompt={s['G']}",
           "--set", f"rollout.max_completion_length={s['max_len']}", "--set", f"train.micro_batch_size={s['micro_batch']}",
           "--set", f"train.learning_rate={s['lr']}", "--set", "train.warmup_steps=0", "--set", "logging.progress=plain",
           "--set", "logging.log_completions=0"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s"}
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: " + (p.stderr or p.stdout)[-1500:]}
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"rows": rows, "wall_s": time.perf_counter() - t0}


def summarise(runs: list[dict], skip: int) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "no runs"}

    def med(rows, key):
        return statistics.median(r.get(key, 0.0) for r in rows)

    per = [r["rows"][skip:] or r["rows"] for r in ok]
    keys = ["time/step", "time/generate", "time/train", "time/sync", "time/reward", "async/actor_generate_s"]
    out = {k: statistics.median(med(rows, k) for rows in per) for k in keys}
    out["step_s_per_run"] = [round(med(rows, "time/step"), 4) for rows in per]
    out["runs"] = len(ok)
    out["staleness"] = sorted({r.get("staleness", 0.0) for rows in per for r in rows})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["tiny", "5m"], default="5m")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="leading steps left out of the medians")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-6,
                    help="small, so completion lengths (the work per step) stay alike across steps and variants")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(RESULTS_DIR / "async_mode.json"))
    args = ap.parse_args()
    cache = Path(os.environ.get("GRPO_BENCH_CACHE", "/tmp/grpo-bench"))
    cache.mkdir(parents=True, exist_ok=True)
    if args.size == "tiny":
        from grpo_cli.models.tiny import resolve_model_path

        ckpt, params = resolve_model_path("builtin:tiny"), None
    else:
        ckpt, params = build_checkpoint(args.size, cache)
    s = {"ckpt": ckpt, "steps": args.steps, "prompts": args.prompts, "G": args.G, "max_len": args.max_len,
         "micro_batch": args.micro_batch, "lr": args.lr}
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for rep in range(args.repeats):
        for name in VARIANTS:
            res = run_variant(name, s, args.timeout)
            print(f"round {rep + 1} {name}: " + (res.get("error") or f"{res['wall_s']:.1f}s wall"), flush=True)
            runs[name].append(res)
    summary = {name: summarise(r, args.skip) for name, r in runs.items()}
    rows = [["variant", "s/step (median)", "trainer waits for rollout s", "actor generate s", "train s", "sync s",
             "staleness"]]
    for name, m in summary.items():
        if "error" in m:
            rows.append([name, "error", m["error"][:60], "", "", "", ""])
            continue
        rows.append([name, f"{m['time/step']:.3f}", f"{m['time/generate']:.3f}",
                     f"{m['async/actor_generate_s']:.3f}" if name != "sync" else "-", f"{m['time/train']:.3f}",
                     f"{m['time/sync']:.3f}", ",".join(f"{x:.0f}" for x in m["staleness"])])
    print(fmt_table(rows))
    ratios = {}
    if all("error" not in summary[k] for k in VARIANTS):
        ratios = {"async_s1_over_sync": summary["async s=1"]["time/step"] / summary["sync"]["time/step"],
                  "async_s1_over_async_s0": summary["async s=1"]["time/step"] / summary["async s=0"]["time/step"]}
        print(f"step time async(s=1) / sync = {ratios['async_s1_over_sync']:.2f}; "
              f"async(s=1) / async(s=0) = {ratios['async_s1_over_async_s0']:.2f}")
    load = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "settings": {**s, "size": args.size, "params": params, "skip": args.skip, "repeats": args.repeats},
        "machine": machine_info(), "load_average_after": load, "summary": summary, "ratios": ratios,
        "raw_step_s": {k: [[r["time/step"] for r in x["rows"]] for x in v if "rows" in x] for k, v in runs.items()},
    }, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
