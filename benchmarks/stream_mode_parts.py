"""The parts of `benchmarks/stream_mode.py`: its checkpoint (uniform next token, so lengths are geometric), CPU
pinning, the decode-cost calibration against the running `vllm serve`, one arm's `grpo train` run and its summary."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = [(1, 64), (1, 384), (32, 64), (32, 384), (96, 64), (96, 384)]
"""(sequences, tokens each) of the timed decode requests."""
WORKLOAD_VERSION = 1


def workload_checkpoint(cache: Path, vocab: int | None) -> str:
    """The built-in tiny Llama's shape (hidden 64, 2 layers) with `lm_head` zeroed: every next token is uniform over
    the vocabulary, so a completion ends at each token with probability 1/V (geometric lengths, mean ~V), and
    positions up to 1024 (512 completion tokens after the prompt). Built once under `cache`."""
    path = cache / f"stream-uniform-{vocab or 'base'}"
    marker = path / "stream_workload.json"
    if marker.exists() and json.loads(marker.read_text()).get("version") == WORKLOAD_VERSION:
        return str(path)
    from safetensors.torch import load_file, save_file

    from grpo_cli.models.tiny import build_tiny_checkpoint

    build_tiny_checkpoint(path, vocab_size=vocab)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"].zero_()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (path / "config.json").write_text(json.dumps(config, indent=2))
    marker.write_text(json.dumps({"version": WORKLOAD_VERSION, "vocab": vocab}))
    return str(path)


def prompt_ids(ckpt: str) -> list[int]:
    """A `builtin:words` prompt rendered by the checkpoint's chat template (the benchmark's prompts all have its
    length: "please VERB words about the TOPIC")."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok.apply_chat_template([{"role": "user", "content": "please say words about the cat"}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def prompt_length(ckpt: str) -> int:
    return len(prompt_ids(ckpt))


@contextlib.contextmanager
def pinned(cpus: set[int], **env: str):
    """This process (and what it starts meanwhile) on `cpus`, with `env` set; both restored after."""
    before, saved = os.sched_getaffinity(0), {k: os.environ.get(k) for k in env}
    usable = cpus & before or before  # a machine without those cores: run unpinned
    os.sched_setaffinity(0, usable)
    os.environ.update(env)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def calibrate_decode(url: str, model: str, prompt: list[int], repeats: int = 2) -> dict:
    """Time requests of c samples × T tokens (EOS ignored, so exactly T) and fit
    t = d + a·T + b·c·T + k·c·(p·T + T²/2): the simulator's decode_fixed_s (a), decode_per_seq_s (b) and
    decode_per_ctx_s (k), plus a per-request overhead d (HTTP, prefill)."""
    import httpx
    import numpy as np

    p, rows, times = len(prompt), [], []
    for c, n in CALIBRATION:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            r = httpx.post(f"{url}/v1/completions", timeout=600, json={
                "model": model, "prompt": prompt, "n": c, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                "temperature": 1.0, "seed": 0})
            r.raise_for_status()
            best = min(best, time.perf_counter() - start)
        rows.append([1.0, n, c * n, c * (p * n + n * n / 2)])
        times.append(best)
    coef = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)[0]
    if coef[3] < 0:  # noise: refit without the context term
        coef = [*np.linalg.lstsq(np.array(rows)[:, :3], np.array(times), rcond=None)[0], 0.0]
    d, a, b, k = (max(0.0, float(x)) for x in coef)
    return {"overhead_s": d, "fixed_s": a, "per_seq_s": b, "per_ctx_s": k, "prompt_len": p,
            "points": [{"seqs": c, "tokens": n, "seconds": t} for (c, n), t in zip(CALIBRATION, times)]}


def stream_accepted(args: list[str]) -> bool:
    """Whether this grpo-cli's config takes the stream arm's settings (`rollout.mode: stream` may not be merged)."""
    from grpo_cli.config.load import build_config

    preset = args[args.index("--preset") + 1]
    overrides = [args[i + 1] for i, x in enumerate(args) if x == "--set"]
    try:
        build_config(preset, overrides=overrides)
    except Exception as exc:  # noqa: BLE001 - any refusal means: not available here
        print(f"stream arm refused by the config: {str(exc).splitlines()[0][:200]}", flush=True)
        return False
    return True


def _pin_actors(pid: int, core: int, stop: threading.Event) -> None:
    """Async arm: the trainer runs on core 1 (taskset); its Ray rollout actor, once it appears, goes to `core`."""
    import psutil

    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "RolloutActor" in " ".join(child.cmdline()):
                        for proc in [child, *child.children(recursive=True)]:
                            if proc.cpu_affinity() != [core]:
                                proc.cpu_affinity([core])
        stop.wait(0.5)


def run_arm(args: list[str], timeout: float, *, actor_core: int | None = None, trainer_core: int = 1) -> dict:
    """One `grpo train` subprocess on `trainer_core`; per-step rows of its metrics.jsonl."""
    out = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    taskset = ["taskset", "-c", str(trainer_core)] if trainer_core in os.sched_getaffinity(0) else []
    cmd = [*taskset, sys.executable, "-m", "grpo_cli", "train", *args, "--output-dir", str(out / "run")]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               VLLM_CPU_OMP_THREADS_BIND=str(actor_core if actor_core is not None else trainer_core),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = (out / "train.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    stop = threading.Event()
    watcher = None
    if actor_core is not None:
        watcher = threading.Thread(target=_pin_actors, args=(proc.pid, actor_core, stop), daemon=True)
        watcher.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    finally:
        stop.set()
        log.close()
    tail = (out / "train.log").read_text()[-2000:]
    if code != 0:
        return {"error": f"exit {code}" + (" (timeout)" if code is None else "") + ": " + tail,
                "cmd": shlex.join(cmd)}
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"rows": [r for r in rows if "time/step" in r], "wall_s": time.perf_counter() - t0, "cmd": shlex.join(cmd)}


def summarise_arm(runs: list[dict], skip: int, batch: int, prompt_len: int) -> dict:
    """Medians over the arm's runs (seeds) of: trained completion tokens/s and step time over the steps after
    `skip`, engine idle fraction, train seconds per token, sync seconds; the reward of every step per run."""
    ok = [r for r in runs if "rows" in r and len(r["rows"]) > skip]
    if not ok:
        return {"error": next((r["error"] for r in runs if "error" in r), "no runs")}
    per = []
    for r in ok:
        rows = r["rows"][skip:]
        step = sum(x["time/step"] for x in rows)
        tokens = sum(x["completions/mean_length"] * batch for x in rows)
        if "stream/engine_idle_frac" in rows[0]:
            idle = statistics.fmean(x["stream/engine_idle_frac"] for x in rows)
        elif "async/actor_generate_s" in rows[0]:
            idle = 1 - sum(x["async/actor_generate_s"] for x in rows) / step
        else:
            idle = 1 - sum(x.get("time/generate", 0.0) for x in rows) / step
        trainer = [(x["time/step"] - x.get("time/generate", 0.0) - x.get("time/sync", 0.0))
                   / (batch * (x["completions/mean_length"] + prompt_len)) for x in rows]
        per.append({"tokens_per_s": tokens / step, "step_s": statistics.median(x["time/step"] for x in rows),
                    "engine_idle_frac": idle, "train_s_per_token": statistics.median(trainer),
                    "sync_s": statistics.median(x.get("time/sync", 0.0) for x in rows),
                    "mean_length": statistics.fmean(x["completions/mean_length"] for x in rows),
                    "max_version_lag": max((x.get("stream/version_lag_max", 0.0) for x in rows), default=0.0)})
    out = {k: statistics.median(p[k] for p in per) for k in per[0]}
    out["runs"] = len(ok)
    out["per_run"] = per
    out["reward_per_step"] = [[x.get("reward/mean") for x in r["rows"]] for r in ok]
    out["final_reward"] = [statistics.fmean(x.get("reward/mean", 0.0) for x in r["rows"][-3:]) for r in ok]
    return out
