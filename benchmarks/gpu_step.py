"""One GRPO step on one GPU, grpo-cli's hf engine beside TRL's GRPOTrainer (issue 37's measurement), sized to fit
one 10-minute call of the device tool.

Both systems train the same locally built random-init Qwen2-shaped model (`--size 151m`: hidden 1024, 16 layers,
the character tokenizer) from float32 weights computing in bf16 (grpo-cli: ddp's autocast, whose hf engine decodes a
bf16 copy of the weights on static-shape, CUDA-graphed steps; TRL: `bf16=True`), on prompts "a+b=" with reward
−|20 − characters|, P 16 × G 8, T 128, lr 1e-3, β 0, one optimizer step per batch. Each system runs in a fresh
subprocess; the table gives the median s/step after the first two steps, grpo-cli's generate phase and its time per
decode step (generate time / the longest completion of the call, prefill included: an upper bound), and the peak
GPU memory of the process (`torch.cuda.max_memory_allocated`/`max_memory_reserved`; on CPU the peak RSS).

Run on a GPU: `python -m benchmarks.gpu_step` (docs/gpu-tests.md: how in one device call, TRL's wheel carried).
CPU smoke: `python -m benchmarks.gpu_step --device cpu --quick` (a tiny model, a few steps; no GPU figure).
Results: `benchmarks/results/gpu_step[-DEVICE][-quick].json`. `--no-trl` skips TRL; `--set KEY=VALUE` passes grpo-cli
overrides (e.g. `rollout.compile=true`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.compare import MARK, fmt_table, machine_info, peak_rss_mb, run_module_worker

RESULTS_DIR = Path(__file__).parent / "results"
SIZES = {"151m": dict(hidden_size=1024, num_layers=16, arch="qwen2", chars=True),
         "tiny": dict(hidden_size=64, num_layers=2, arch="qwen2", chars=True)}
TARGET_CHARS = 20
WARMUP_STEPS = 2


def prompts_file(root: Path, n: int = 512) -> Path:
    """`n` prompts "a+b=" (plain text, no chat template) as a .jsonl `data.source`."""
    import random

    rng = random.Random(0)
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{rng.randint(0, 99)}+{rng.randint(0, 99)}="}) + "\n"
                            for _ in range(n)))
    return path


def memory(device: str) -> dict:
    import torch

    out = {"peak_rss_mb": peak_rss_mb()}
    if device == "cuda":
        out |= {"gpu": torch.cuda.get_device_name(), "gpu_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
                "gpu_max_reserved_mb": torch.cuda.max_memory_reserved() / 2**20}
    return out


def timed_generate(device: str) -> list[dict]:
    """Record every hf-engine `generate` call: seconds (synchronised) and the longest completion (decode steps)."""
    import torch

    from grpo_cli.rollout.hf import engine as hf

    calls: list[dict] = []
    real = hf.HFEngine.generate

    def generate(self, prompt_ids, sampling, **kwargs):
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        batch = real(self, prompt_ids, sampling, **kwargs)
        sync()
        calls.append({"s": time.perf_counter() - start, "steps": max(len(c) for c in batch.completion_ids)})
        return batch

    hf.HFEngine.generate = generate
    return calls


def worker_grpo(s: dict) -> dict:
    from grpo_cli.config.load import build_config
    from grpo_cli.train.run import run_training

    calls = timed_generate(s["device"])
    overrides = [
        f"model.name_or_path={s['ckpt']}", f"distributed.device={s['device']}", f"model.dtype={s['dtype']}",
        f"train.steps={s['steps']}", f"train.prompts_per_step={s['prompts']}", f"train.generations_per_prompt={s['G']}",
        f"train.micro_batch_size={s['prompts'] * s['G']}", f"rollout.max_completion_length={s['max_len']}",
        f"train.learning_rate={s['lr']}", "train.warmup_steps=0", "train.lr_scheduler=constant",
        "rollout.temperature=1.0", "algorithm.kl.beta=0.0", f"data.source={s['prompts_file']}",
        f"rewards.functions=[{{name: length, weight: 1.0, kwargs: {{target: {TARGET_CHARS}, unit: chars}}}}]",
        "logging.log_completions=0", "checkpoint.every_steps=0", "eval.every_steps=0",
    ] + list(s.get("grpo_set", []))
    out = Path(tempfile.mkdtemp(prefix="bench-gpu-grpo-"))
    run_training(build_config("tiny-cpu", None, overrides), output_dir=str(out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"step_s": [r["time/step"] for r in rows], "generate_s": [r.get("time/generate", 0.0) for r in rows],
            "decode_step_ms": [1e3 * c["s"] / max(c["steps"], 1) for c in calls],
            "mean_length": [r["completions/mean_length"] for r in rows]}


def worker_trl(s: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def length_reward(prompts, completions, **_):
        return [float(-abs(TARGET_CHARS - len(c))) for c in completions]

    class Timer(TrainerCallback):
        def __init__(self):
            self.t, self.steps = None, []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(time.perf_counter() - self.t)

    n, bf16 = s["prompts"] * s["G"], s["dtype"] == "bfloat16"
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-gpu-trl-"), max_steps=s["steps"], per_device_train_batch_size=n,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=s["G"],
        max_completion_length=s["max_len"], temperature=1.0, top_p=1.0, beta=0.0, learning_rate=s["lr"],
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, num_iterations=1, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=s["device"] == "cpu", bf16=bf16, fp16=False, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False, gradient_checkpointing=False)
    rows = [json.loads(line) for line in Path(s["prompts_file"]).read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(s["ckpt"], dtype=torch.float32)
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(s["ckpt"]), callbacks=[timer])
    trainer.train()
    return {"step_s": timer.steps}


def worker_main(system: str, settings: str) -> None:
    s = json.loads(settings)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    res = worker_trl(s) if system == "trl" else worker_grpo(s)
    print(MARK + json.dumps(res | memory(s["device"])), flush=True)


def run_worker(system: str, s: dict, timeout: float) -> dict:
    return run_module_worker("benchmarks.gpu_step", system, s, timeout)


def _median(values: list[float], skip: int = WARMUP_STEPS) -> float | None:
    kept = values[skip:] or values
    return statistics.median(kept) if kept else None


def summarise(res: dict) -> dict:
    if "error" in res:
        return res
    out = {k: v for k, v in res.items() if not isinstance(v, list)}
    out["step_s"] = _median(res["step_s"])
    out["first_step_s"] = res["step_s"][0] if res["step_s"] else None
    for key in ("generate_s", "decode_step_ms"):
        if key in res:
            out[key] = _median(res[key])
    return out


def table(results: dict) -> str:
    def fmt(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    rows = [["system", "s/step", "generate s", "decode ms/step", "GPU max alloc MB", "GPU max reserved MB",
             "peak RSS MB"]]
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "error: " + r["error"][-80:].replace("\n", " "), "", "", "", "", ""])
            continue
        rows.append([name, fmt(r["step_s"]), fmt(r.get("generate_s")), fmt(r.get("decode_step_ms"), ".2f"),
                     fmt(r.get("gpu_max_allocated_mb"), ".0f"), fmt(r.get("gpu_max_reserved_mb"), ".0f"),
                     fmt(r["peak_rss_mb"], ".0f")])
    return fmt_table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny model, P 2 x G 2, T 8, 3 steps (a smoke)")
    ap.add_argument("--size", default=None, choices=sorted(SIZES), help="default: 151m (tiny with --quick)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gens", dest="G", type=int, default=8)
    ap.add_argument("--tokens", dest="max_len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--set", dest="grpo_set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--timeout", type=float, default=270, help="seconds per system")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.worker:
        return worker_main(a.worker, a.settings)
    if a.quick:
        a.prompts, a.G, a.max_len, a.steps = 2, 2, 8, 3
    size = a.size or ("tiny" if a.quick else "151m")
    with tempfile.TemporaryDirectory() as tmp:
        from grpo_cli.models.tiny import build_tiny_checkpoint

        ckpt = build_tiny_checkpoint(Path(tmp) / f"bench-{size}", **SIZES[size])
        s = {"ckpt": str(ckpt), "prompts_file": str(prompts_file(Path(tmp))), "device": a.device, "dtype": a.dtype,
             "prompts": a.prompts, "G": a.G, "max_len": a.max_len, "steps": a.steps, "lr": a.lr,
             "grpo_set": a.grpo_set}
        systems = ["grpo-hf"] + ([] if a.no_trl else ["trl"])
        results = {name: summarise(run_worker("trl" if name == "trl" else "grpo", s, a.timeout)) for name in systems}
        params = sum(p.numel() for p in _load_params(ckpt))
    print(f"# {size} ({params / 1e6:.1f}M parameters), P {a.prompts} x G {a.G}, T {a.max_len}, {a.dtype}, "
          f"{a.device}; medians after step {WARMUP_STEPS}")
    print(table(results))
    if "trl" in results and "error" not in results["trl"] and "error" not in results["grpo-hf"]:
        print(f"speed grpo-cli / TRL: {results['trl']['step_s'] / results['grpo-hf']['step_s']:.2f}x")
    out = Path(a.out) if a.out else RESULTS_DIR / f"gpu_step-{a.device}{'-quick' if a.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": {k: v for k, v in s.items() if k not in ("ckpt", "prompts_file")}
                               | {"size": size, "params": params}, "results": results,
                               "machine": machine_info()}, indent=2))
    print(f"wrote {out}")


def _load_params(ckpt: Path):
    from safetensors.torch import load_file

    return [t for f in Path(ckpt).glob("*.safetensors") for t in load_file(str(f)).values()]


if __name__ == "__main__":
    main()
