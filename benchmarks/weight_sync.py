"""Weight-sync throughput of `grpo serve-rollout` on one host: seconds per sync (the first, then the median of the
rest: a run syncs every step) and MB/s for the tiny model and a
~100M-parameter random Llama (both built locally), over loopback HTTP and through the /dev/shm file transport
(integrity checks on in both), printed as a table and written to `benchmarks/results/weight_sync.json`.
The transports take turns against one server (http, shm, http, shm, ...), so a machine whose load changes during
the run weighs on both alike; `ratio` is each transport's median over the last one's (on a shared machine the
absolute figures move with the load, the ratio much less).
Run: `python -m benchmarks.weight_sync [--repeats N] [--transport http shm] [--out PATH] [--generation-check]`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "weight_sync.json"
READY = "grpo serve-rollout: listening on "


def build_100m(path: Path) -> Path:
    """Random Llama: vocab 32000, hidden 768, 8 layers, MLP 2048, untied head: ~106M parameters, fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def start_server(model: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli.cli.serve", "--engine", "hf", "--model", str(model),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    found: list[str] = []
    done = threading.Event()

    def pump():
        for line in proc.stdout:
            if line.startswith(READY):
                found.append(line[len(READY):].split()[0])
                done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    done.wait(180)
    if not found:
        proc.kill()
        raise RuntimeError(f"server for {model} did not start")
    return proc, found[0]


def measure(name: str, model: Path, repeats: int, chunk_mb: int, transports: list[str]) -> list[dict]:
    """One server; the transports' syncs alternate (each its own client, versions counting up across them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_cli.rollout.remote.client import ServerEngine

    proc, url = start_server(model)
    times: dict[str, list[float]] = {t: [] for t in transports}
    try:
        trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        params = sum(p.numel() for p in trainer.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
        engines = {t: ServerEngine([url], chunk_mb=chunk_mb, transport=t) for t in transports}
        version = 0
        for _ in range(repeats):
            for transport, eng in engines.items():
                version += 1
                start = time.perf_counter()
                eng.update_weights(trainer.named_parameters(), version)
                times[transport].append(time.perf_counter() - start)
        for eng in engines.values():
            eng.close()
    finally:
        proc.kill()
        proc.wait()
    rows = []
    for transport, ts in times.items():
        steady = sorted(ts[1:] or ts)  # the first sync also pays one-time costs (first allocation of the file)
        median = steady[len(steady) // 2]
        rows.append({"model": name, "transport": transport, "parameters": params, "bytes": nbytes, "dtype": "float32",
                     "chunk_mb": chunk_mb, "repeats": repeats, "seconds_first": ts[0], "seconds_median": median,
                     "seconds_best": min(ts), "seconds_all": ts, "mb_per_s_first": nbytes / 2**20 / ts[0],
                     "mb_per_s_median": nbytes / 2**20 / median, "mb_per_s_best": nbytes / 2**20 / min(ts)})
    for r in rows:
        r["ratio_to_" + transports[-1]] = rows[-1]["seconds_median"] / r["seconds_median"]
    return rows


def generation_check(model: Path, rounds: int = 2, calls: int = 3) -> list[dict]:
    """Generate speed of the server before and after an HTTP update, per round (median of `calls` generates of
    2 prompts x 8 tokens each): the update's copies run on one thread (`server/weights.LOAD_THREADS`) and the
    thread count must come back for generation."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    from grpo_cli.rollout.base import SamplingParams
    from grpo_cli.rollout.remote.client import ServerEngine

    proc, url = start_server(model)
    out = []
    try:
        trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        eng = ServerEngine([url], transport="http")
        sampling = SamplingParams(n=1, max_tokens=8, temperature=1.0, seed=0)

        def timed() -> float:
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                eng.generate([[3, 4, 5, 6], [4, 4, 5, 6]], sampling)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        timed()
        for _ in range(rounds):
            before = timed()
            eng.update_weights(trainer.named_parameters(), eng.weight_version + 1)
            out.append({"generate_s_before_update": before, "generate_s_after_update": timed()})
        eng.close()
    finally:
        proc.kill()
        proc.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--chunk-mb", type=int, default=128)
    ap.add_argument("--transport", nargs="+", default=["http", "shm"], choices=["http", "shm"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--generation-check", action="store_true",
                    help="also time the 100M server's generate before and after HTTP updates")
    args = ap.parse_args()
    from grpo_cli.models.tiny import build_tiny_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny, big = build_tiny_checkpoint(Path(tmp) / "tiny"), build_100m(Path(tmp) / "l100m")
        load_before = os.getloadavg()
        rows += measure("tiny (2-layer Llama)", tiny, args.repeats, args.chunk_mb, args.transport)
        rows += measure("random Llama ~100M", big, args.repeats, args.chunk_mb, args.transport)
        generation = generation_check(big) if args.generation_check else []
        load_after = os.getloadavg()
    ratio = "ratio_to_" + args.transport[-1]
    print(f"{'model':<22} {'transport':>9} {'params':>12} {'MB':>9} {'s first':>8} {'s median':>9} "
          f"{'MB/s first':>11} {'MB/s median':>12} {'MB/s best':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:<22} {r['transport']:>9} {r['parameters']:>12,} {r['bytes'] / 2**20:>9.1f} "
              f"{r['seconds_first']:>8.3f} {r['seconds_median']:>9.3f} {r['mb_per_s_first']:>11.1f} "
              f"{r['mb_per_s_median']:>12.1f} {r['mb_per_s_best']:>10.1f} {r[ratio]:>6.2f}")
    for g in generation:
        print(f"generate s before an update {g['generate_s_before_update']:.3f}, after {g['generate_s_after_update']:.3f}")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"transport": "127.0.0.1 http / same-host /dev/shm file, hf engine server",
                                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                    "load_average_before": load_before, "load_average_after": load_after,
                                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                "platform": platform.platform()},
                                    "results": rows, "generation_check": generation}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
