"""Projected trained tokens/s per GPU of sync, one-step async and stream for 8 rollout + 8 training H100s on a 7B model
(Qwen2.5-7B) with long completions, from published per-GPU figures (`SOURCES`), through `benchmarks/pipeline_sim.py`.

How the inputs are made (docs/benchmarks.md, "Streaming rollouts: the projection"):
- decode step = weights read once (bytes / HBM bandwidth) + per sequence its matmul FLOPs (2 x params / dense BF16
  peak) + per context token its KV-cache read (bytes / bandwidth), with efficiencies `BW_EFF` and `FLOP_EFF`;
  checked against a published vLLM throughput of an 8B model on one H100;
- train seconds per token, two ways: (a) the rate at which the simulator reproduces NeMo-RL's published
  synchronous Llama-3.1-8B GRPO run (16 colocated H100s, 1,562 tokens/s/GPU); (b) Megatron-Bridge's published FP8
  pre-training rate of Llama-3 8B on H100, at BF16's peak and with the two extra forwards an RL step makes (policy
  and reference logprobs); both scaled to 7B by the parameter count;
- completion lengths: lognormal (sigma 0.8) clipped at max_completion_length, mean ~1/4 of the cap.
Run: `python -m benchmarks.pipeline_projection` (seconds). Results: `benchmarks/results/stream_projection.json`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.pipeline_sim import Hardware, Workload, simulate, table

SOURCES = {
    "h100": ("https://www.nvidia.com/en-us/data-center/h100/",
             "H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 (1,979 with sparsity), 80 GB"),
    "llama8b": ("https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
                "Llama-3.1-8B: 8.03B parameters, 32 layers, 8 K/V heads of 128"),
    "qwen7b": ("https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
               "Qwen2.5-7B: 7.62B parameters, 28 layers, 4 K/V heads of 128"),
    "vllm_8b": ("https://www.morphllm.com/vllm-benchmarks",
                "vLLM, Llama 3.1 8B BF16 on 1x H100 80GB: ~12,500 output tokens/s (a compilation of third-party "
                "benchmarks, high concurrency, short ShareGPT-like contexts)"),
    "nemo_rl_perf": ("https://github.com/NVIDIA-NeMo/RL/blob/main/docs/about/performance-summary.md",
                     "NeMo-RL v0.4 GRPO, Llama-3.1-8B, DGX-H100, 16 GPUs, 2,048 samples/step, max 4,096, mean "
                     "generation 1,060: on-policy 1,562 tokens/s/GPU, 97.7 s/step; 1-step off 2,161, 74.6 s"),
    "nemo_rl_1381": ("https://github.com/NVIDIA-NeMo/RL/pull/1381",
                     "NeMo-RL in-flight weight updates, Llama-8B 4K: sync ~187 tokens/s/GPU (4 nodes), async + "
                     "in-flight ~478 (5 nodes: 4 train, 1 generate); step ~60 s -> ~21 s"),
    "megatron_bridge": ("https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary.md",
                        "Megatron-Bridge 25.11, LLAMA3_8B pre-training on 8 DGX-H100 GPUs, FP8-CS, seq 8,192: "
                        "14,451 tokens/s/GPU (744 model TFLOP/s/GPU)"),
    "nemo_rl_refit": ("https://github.com/NVIDIA-NeMo/RL/pull/2808",
                      "NeMo-RL NCCL refit Megatron -> vLLM: 0.07-0.15 s for a 4B model, 0.5-0.7 s for 30B"),
}
H100 = {"bw": 3.35e12, "flops": 989e12, "hbm": 80e9}
MODELS = {"llama8b": {"params": 8.03e9, "layers": 32, "kv_heads": 8, "head_dim": 128},
          "qwen7b": {"params": 7.62e9, "layers": 28, "kv_heads": 4, "head_dim": 128}}
BW_EFF, FLOP_EFF, MEM_UTIL = 0.7, 0.5, 0.9
"""Assumed: share of HBM bandwidth a decode step reaches, share of dense BF16 peak its matmuls reach, share of HBM
vLLM takes (gpu_memory_utilization)."""
MEGATRON_FP8_TOKENS, FP8_PEAK = 14451.0, 1979e12
"""Megatron-Bridge: 14,451 tokens/s/GPU at 744 model TFLOP/s in FP8 (peak 1,979 dense); the same share of the
BF16 peak gives 14,451 x 989/1,979 tokens/s of forward + backward (6N FLOPs per token); an RL step also runs the
policy's and the reference's logprob forwards (2N each): 6N / 10N of that."""
NEMO_PROMPT = 132
"""NeMo-RL's mean prompt: 1,562 x 16 x 97.7 tokens per step / 2,048 samples = 1,192 tokens, minus 1,060 generated."""


def kv_bytes(m: dict) -> float:
    return 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * 2  # K and V, bf16


def decode_rates(model: str, *, mean_context: float) -> dict:
    """The simulator's decode terms for one H100 holding `model` in BF16, and its concurrency cap: the sequences
    whose KV cache (at `mean_context` tokens each) fits in what the weights leave."""
    m = MODELS[model]
    free = H100["hbm"] * MEM_UTIL - 2 * m["params"]
    return {"decode_fixed_s": 2 * m["params"] / (H100["bw"] * BW_EFF),
            "decode_per_seq_s": 2 * m["params"] / (H100["flops"] * FLOP_EFF),
            "decode_per_ctx_s": kv_bytes(m) / (H100["bw"] * BW_EFF),
            "max_seqs": max(1, int(free / kv_bytes(m) / mean_context))}


def vllm_check() -> dict:
    """Our decode model for Llama-3.1-8B at 256 sequences of ~500 context tokens against the published ~12,500/s."""
    r = decode_rates("llama8b", mean_context=500)
    step = r["decode_fixed_s"] + 256 * (r["decode_per_seq_s"] + 500 * r["decode_per_ctx_s"])
    return {"model_tokens_per_s": 256 / step, "published_tokens_per_s": 12500}


def lengths(cap: int) -> dict:
    return {"kind": "lognormal", "median": cap / 5.5, "sigma": 0.8, "min": 16, "max": cap}


def nemo_hardware(train_s_per_token: float) -> tuple[Hardware, Workload]:
    """NeMo-RL's published synchronous run: 16 colocated H100s, Llama-3.1-8B, 2,048 samples (512 x 4 here: their
    prompts and G are not in the table; the step sees the same samples), max 4,096, mean generation ~1,060."""
    r = decode_rates("llama8b", mean_context=NEMO_PROMPT + 1060)
    hw = Hardware(rollout_engines=16, train_gpus=16, train_s_per_token=train_s_per_token, sync_s=2.0,
                  colocated=True, prefill_s_per_token=2 * MODELS["llama8b"]["params"] / (H100["flops"] * FLOP_EFF),
                  **r)
    w = Workload(steps=4, prompts_per_step=512, generations=4, prompt_len=NEMO_PROMPT,
                 lengths={"kind": "lognormal", "median": 770, "sigma": 0.8, "min": 16, "max": 4096})
    return hw, w


def calibrate_train(target: float = 1562.0) -> dict:
    """The train seconds per token (one H100, Llama-3.1-8B) at which the simulated NeMo-RL sync run gives `target`
    trained tokens (prompt + completion) per second per GPU, by bisection on a log scale."""
    lo, hi = 1e-6, 1e-2
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        hw, w = nemo_hardware(mid)
        r = simulate(hw, w, ["sync"])["sync"]
        rate = r["trained_tokens"] / r["seconds"] / hw.gpus
        lo, hi = (mid, hi) if rate > target else (lo, mid)
    hw, w = nemo_hardware(lo)
    r = simulate(hw, w, ["sync"])["sync"]
    return {"train_s_per_token": lo, "train_tokens_per_s_per_gpu": 1 / lo,
            "sim_tokens_per_s_per_gpu": r["trained_tokens"] / r["seconds"] / hw.gpus, "sim_step_s": r["step_s_median"],
            "published": {"tokens_per_s_per_gpu": target, "step_s": 97.7}}


def megatron_rate() -> float:
    """Train tokens/s of one H100 on Llama-3-8B in an RL step, from Megatron-Bridge's pre-training figure."""
    return MEGATRON_FP8_TOKENS * H100["flops"] / FP8_PEAK * 6 / 10


def project(cap: int, train_s_per_token_8b: float, *, lag: int, in_flight: float, prompts: int = 64, G: int = 16,
            steps: int = 16, rollout_gpus: int = 8, train_gpus: int = 8) -> dict:
    """Sync, async and stream on `rollout_gpus` + `train_gpus` H100s, and sync colocated on all of them."""
    prompt = 256
    mean = lengths(cap)["median"] * 1.377
    r = decode_rates("qwen7b", mean_context=prompt + mean)
    per_token = train_s_per_token_8b * MODELS["qwen7b"]["params"] / MODELS["llama8b"]["params"]
    hw = Hardware(rollout_engines=rollout_gpus, train_gpus=train_gpus, train_s_per_token=per_token, sync_s=1.0,
                  prefill_s_per_token=2 * MODELS["qwen7b"]["params"] / (H100["flops"] * FLOP_EFF), **r)
    pool = int(prompts * in_flight)
    w = Workload(steps=steps, prompts_per_step=prompts, generations=G, prompt_len=prompt, lengths=lengths(cap),
                 max_in_flight=pool, max_version_lag=lag, max_buffered=pool)
    res = simulate(hw, w, ["sync"])
    res["async"] = simulate(hw, replace(w, max_version_lag=1), ["async"])["async"]
    res["stream"] = simulate(hw, w, ["stream"])["stream"]
    everyone = rollout_gpus + train_gpus
    colo = replace(hw, rollout_engines=everyone, train_gpus=everyone, colocated=True)
    res["sync colocated"] = simulate(colo, w, ["sync"])["sync"]
    res["sync colocated"]["schedule"] = f"sync colocated ({everyone})"
    per_gpu = {k: r["tokens_per_s_per_gpu"] for k, r in res.items()}
    return {"hardware": asdict(hw), "workload": asdict(w), "results": res,
            "stream_over_sync": per_gpu["stream"] / per_gpu["sync"],
            "stream_over_sync_colocated": per_gpu["stream"] / per_gpu["sync colocated"],
            "stream_over_async": res["stream"]["tokens_per_s"] / res["async"]["tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caps", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--lag", type=int, default=4, help="stream: rollout.stream.max_version_lag")
    ap.add_argument("--in-flight", type=float, default=1.5, help="stream: max_in_flight in steps' worth of groups")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "stream_projection.json"))
    a = ap.parse_args()
    v = vllm_check()
    print(f"decode model, Llama-3.1-8B on one H100, 256 x ~500-token contexts: {v['model_tokens_per_s']:.0f} "
          f"tokens/s (published ~{v['published_tokens_per_s']})")
    cal = calibrate_train()
    mb = megatron_rate()
    print(f"train rate (Llama-3.1-8B, one H100, logprobs + forward/backward + step): (a) {1 / cal['train_s_per_token']:.0f}"
          f" tokens/s reproduces NeMo-RL's sync run (simulated {cal['sim_tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
          f"step {cal['sim_step_s']:.1f} s vs 1,562 and 97.7 published); (b) {mb:.0f} from Megatron-Bridge's figure")
    out = {"sources": SOURCES, "assumptions": {"bw_eff": BW_EFF, "flop_eff": FLOP_EFF, "mem_util": MEM_UTIL,
                                               "stream_lag": a.lag, "stream_in_flight_steps": a.in_flight},
           "vllm_check": v, "train_calibration": cal, "train_megatron_tokens_per_s": mb, "projections": {}}
    for label, per_token in (("a: NeMo-RL sync fit", cal["train_s_per_token"]), ("b: Megatron-Bridge", 1 / mb)):
        for cap in a.caps:
            p = project(cap, per_token, lag=a.lag, in_flight=a.in_flight)
            out["projections"][f"{label}, cap {cap}"] = p
            print(f"\n[{label}] 8 rollout + 8 training H100, Qwen2.5-7B, completions up to {cap} (lognormal, mean "
                  f"~{lengths(cap)['median'] * 1.377:.0f}), 64 prompts x 16; stream: lag <= {a.lag}, "
                  f"{a.in_flight:g} steps of groups in flight")
            print(table(p["results"]))
            print(f"tokens/s/GPU: stream / sync {p['stream_over_sync']:.2f}x (colocated sync "
                  f"{p['stream_over_sync_colocated']:.2f}x; goal >= 2), stream / async {p['stream_over_async']:.2f}x "
                  "(goal >= 1.3)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\nresults: {a.out}")


if __name__ == "__main__":
    main()
