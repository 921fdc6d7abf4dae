"""Projected trained tokens/s per GPU of sync, one-step async and stream for 8 rollout + 8 training H100s on a 7B model
(Qwen2.5-7B) with long completions, from published per-GPU figures (`SOURCES`), through `benchmarks/pipeline_sim.py`.

How the inputs are made (docs/benchmarks.md, "Streaming rollouts: the projection"):
- decode step = weights read once (bytes / HBM bandwidth) + per sequence its matmul FLOPs (2 x params / dense BF16
  peak) + per context token its KV-cache read (bytes / bandwidth), with efficiencies `BW_EFF` and `FLOP_EFF`;
  checked against a published vLLM throughput of an 8B model on one H100;
- train seconds per token: the rate at which the simulator reproduces NeMo-RL's published synchronous Llama-3.1-8B
  GRPO run (16 colocated H100s, 1,562 tokens/s/GPU), checked against Megatron-Bridge's published pre-training rate;
  scaled to 7B by the parameter count;
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


def project(cap: int, train_s_per_token_8b: float, *, lag: int, prompts: int = 64, G: int = 16,
            steps: int = 16) -> dict:
    prompt = 256
    mean = lengths(cap)["median"] * 1.377
    r = decode_rates("qwen7b", mean_context=prompt + mean)
    per_token = train_s_per_token_8b * MODELS["qwen7b"]["params"] / MODELS["llama8b"]["params"]
    hw = Hardware(rollout_engines=8, train_gpus=8, train_s_per_token=per_token, sync_s=1.0,
                  prefill_s_per_token=2 * MODELS["qwen7b"]["params"] / (H100["flops"] * FLOP_EFF), **r)
    in_flight = max(prompts, 8 * r["max_seqs"] // G)  # fill every engine's cap
    w = Workload(steps=steps, prompts_per_step=prompts, generations=G, prompt_len=prompt, lengths=lengths(cap),
                 max_in_flight=in_flight, max_version_lag=lag, max_buffered=in_flight)
    res = simulate(hw, w)
    res["async"] = simulate(hw, replace(w, max_version_lag=1), ["async"])["async"]
    return {"hardware": asdict(hw), "workload": asdict(w), "results": res,
            "stream_over_sync": res["stream"]["tokens_per_s"] / res["sync"]["tokens_per_s"],
            "stream_over_async": res["stream"]["tokens_per_s"] / res["async"]["tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caps", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--lag", type=int, default=2, help="stream: rollout.stream.max_version_lag")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "stream_projection.json"))
    a = ap.parse_args()
    v = vllm_check()
    print(f"decode model, Llama-3.1-8B on one H100, 256 x ~500-token contexts: {v['model_tokens_per_s']:.0f} "
          f"tokens/s (published ~{v['published_tokens_per_s']})")
    cal = calibrate_train()
    print(f"train rate that reproduces NeMo-RL's sync run: {cal['train_tokens_per_s_per_gpu']:.0f} tokens/s per H100 "
          f"(Llama-3.1-8B, logprobs + forward/backward + step); simulated step {cal['sim_step_s']:.1f} s vs 97.7")
    out = {"sources": SOURCES, "assumptions": {"bw_eff": BW_EFF, "flop_eff": FLOP_EFF, "mem_util": MEM_UTIL},
           "vllm_check": v, "train_calibration": cal, "projections": {}}
    for cap in a.caps:
        p = project(cap, cal["train_s_per_token"], lag=a.lag)
        out["projections"][str(cap)] = p
        print(f"\n8 rollout + 8 training H100, Qwen2.5-7B, completions up to {cap} (lognormal, mean "
              f"~{lengths(cap)['median'] * 1.377:.0f}), 64 prompts x 16, stream lag <= {a.lag}:")
        print(table(p["results"]))
        print(f"stream / sync {p['stream_over_sync']:.2f}x (goal >= 2), stream / async "
              f"{p['stream_over_async']:.2f}x (goal >= 1.3)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\nresults: {a.out}")


if __name__ == "__main__":
    main()
