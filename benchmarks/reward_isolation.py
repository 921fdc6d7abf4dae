"""Per-call cost of `isolation: process` for a trivial reward (`length`) against calling it inline.

Each round scores N completions inline (one call per completion, as the workers do) and with process isolation
(`workers` 1 and 4; pools started and warmed before timing); rounds alternate, medians reported.
Run: `python -m benchmarks.reward_isolation [--n 200] [--rounds 5]`. Results: benchmarks/results/reward_isolation.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.compare import RESULTS_DIR, fmt_table, machine_info


def main() -> None:
    from grpo_cli.config.rewards import RewardFunctionConfig
    from grpo_cli.rewards import isolated
    from grpo_cli.rewards.resolve import build_reward_fns, score

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    prompts, completions = ["p"] * args.n, ["one two three"] * args.n
    setups = {"inline": build_reward_fns([RewardFunctionConfig(name="length")])}
    for workers in (1, 4):
        setups[f"process, {workers} worker(s)"] = build_reward_fns(
            [RewardFunctionConfig(name="length", isolation="process", workers=workers)])
    inline_fn = setups["inline"][0]

    def run(name: str) -> float:
        start = time.perf_counter()
        if name == "inline":  # one call per completion, like the workers
            for j in range(args.n):
                inline_fn.fn(prompts[j:j + 1], completions[j:j + 1], **inline_fn.kwargs)
        else:
            score(setups[name], prompts, completions, {}, on_error="raise")
        return (time.perf_counter() - start) / args.n * 1000

    for name in setups:  # start and warm the pools
        run(name)
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name in setups:
            times[name].append(run(name))
    med = {name: statistics.median(v) for name, v in times.items()}
    rows = [["setup", "ms per completion (median)", "over inline (ms)"]]
    rows += [[name, f"{m:.3f}", f"{m - med['inline']:+.3f}"] for name, m in med.items()]
    print(f"{args.n} completions × {args.rounds} alternated rounds, trivial `length` reward\n")
    print(fmt_table(rows))
    for pool in isolated._POOLS.values():
        pool.close()
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / "reward_isolation.json"
    out.write_text(json.dumps({"n": args.n, "rounds": args.rounds, "ms_per_call": times, "medians": med,
                               "machine": machine_info()}, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
