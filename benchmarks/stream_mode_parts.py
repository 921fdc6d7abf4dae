"""The parts of `benchmarks/stream_mode.py`: its checkpoint (uniform next token, so lengths are geometric), CPU
pinning, the decode-cost calibration against the running `vllm serve`, one arm's `grpo train` run and its summary."""

from __future__ import annotations

import contextlib
import itertools
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the `vllm serve` harness the tests start servers with

from vllm_serve_harness import own_core  # noqa: E402
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


def calibrate_decode(url: str, prompt: list[int], group: int, repeats: int = 2) -> dict:
    """Time c samples × T tokens (EOS ignored, so exactly T) as the arms ask for them: requests of `group` samples
    (one prompt group each; all at once) on the token-in/token-out route with the sampled tokens' logprobs (which
    cost ~50% more per token at 320 sequences than none, on this machine), and fit
    t = d + a·T + b·c·T + k·c·(p·T + T²/2): the simulator's decode_fixed_s (a), decode_per_seq_s (b) and
    decode_per_ctx_s (k), plus a per-request overhead d (HTTP, prefill)."""
    import httpx

    def ask(n: int, tokens: int, seed: int) -> None:
        httpx.post(f"{url}/inference/v1/generate", timeout=600, json={
            "token_ids": prompt, "request_id": f"calibrate-{time.time_ns()}-{seed}", "cache_salt": f"c{seed}",
            "sampling_params": {"n": n, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
                                "temperature": 1.0, "seed": seed, "logprobs": 0, "detokenize": False},
        }).raise_for_status()

    times = []
    for c, n in CALIBRATION:
        sizes = split(c, group)
        with ThreadPoolExecutor(len(sizes)) as pool:
            times.append(min(timed(lambda: list(pool.map(ask, sizes, [n] * len(sizes), range(len(sizes)))))
                             for _ in range(repeats)))
    return {**fit_decode(times, len(prompt)), "group": group, "engine": "vllm serve"}


def server_ceiling(url: str, prompt: list[int], group: int, groups: int, *, logprobs: bool,
                   seconds: float = 15.0) -> float:
    """Generated tokens/s of the server alone with `groups` requests of `group` samples always in flight (natural
    lengths up to 512, a new request as soon as one returns, no pause, no trainer): what stream mode could reach
    on it at that pool size, with or without the sampled tokens' logprobs (which stream mode needs)."""
    import httpx

    stop, tokens, lock = time.perf_counter() + seconds, [0], threading.Lock()
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=groups + 4)) as client:
        def keep_one(slot: int) -> None:
            for i in itertools.count():
                if time.perf_counter() >= stop:
                    return
                sampling = {"n": group, "max_tokens": 512, "temperature": 1.0, "seed": i, "detokenize": False,
                            **({"logprobs": 0} if logprobs else {})}
                r = client.post(f"{url}/inference/v1/generate", json={
                    "token_ids": prompt, "sampling_params": sampling, "request_id": f"ceiling-{slot}-{i}-{logprobs}",
                    "cache_salt": f"ceiling-{slot}-{i}"})
                r.raise_for_status()
                with lock:
                    tokens[0] += sum(len(c["token_ids"]) for c in r.json()["choices"])

        start = time.perf_counter()
        with ThreadPoolExecutor(groups) as pool:
            list(pool.map(keep_one, range(groups)))
    return tokens[0] / (time.perf_counter() - start)


def split(c: int, group: int) -> list[int]:
    """c samples as requests of `group` samples (the last one smaller)."""
    return [min(group, c - i) for i in range(0, c, group)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fit_decode(times: list[float], p: int) -> dict:
    """Least squares of t = d + a·T + b·c·T + k·c·(p·T + T²/2) over the CALIBRATION points (c, T) and their
    `times`, prompt length `p`."""
    import numpy as np

    rows = [[1.0, n, c * n, c * (p * n + n * n / 2)] for c, n in CALIBRATION]
    coef = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)[0]
    if coef[3] < 0:  # noise: refit without the context term
        coef = [*np.linalg.lstsq(np.array(rows)[:, :3], np.array(times), rcond=None)[0], 0.0]
    d, a, b, k = (max(0.0, float(x)) for x in coef)
    return {"overhead_s": d, "fixed_s": a, "per_seq_s": b, "per_ctx_s": k, "prompt_len": p,
            "points": [{"seqs": c, "tokens": n, "seconds": t} for (c, n), t in zip(CALIBRATION, times)]}


def calibrate_in_process(ckpt: str, prompt: list[int], group: int, core: int) -> dict:
    """The async arm's engine timed as `calibrate_decode` times the server: the `vllm.LLM` its Ray actor runs in
    process (no HTTP server; the arguments `rollout/vllm/support.llm_kwargs` gives the tiny-cpu-async preset, room
    for the largest c), in a subprocess on `core` alone."""
    taskset = own_core(core)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=str(core),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [*taskset, sys.executable, "-m", "benchmarks.stream_mode_parts", ckpt, json.dumps(prompt), str(group)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, check=False)
    if done.returncode:
        raise RuntimeError(f"in-process calibration failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _llm_calibration(ckpt: str, prompt: list[int], group: int, repeats: int = 2) -> dict:
    import vllm

    from grpo_cli.config.load import build_config
    from grpo_cli.rollout.vllm.support import llm_kwargs
    from grpo_cli.rollout.base import engine_dtype

    cfg = build_config("tiny-cpu-async", overrides=[f"model.name_or_path={ckpt}", "rollout.engine=vllm",
                                                    "rollout.vllm.max_model_len=1024"])
    v = cfg.rollout.vllm
    llm = vllm.LLM(**llm_kwargs(
        ckpt, dtype=engine_dtype(cfg), tensor_parallel_size=1, gpu_memory_utilization=v.gpu_memory_utilization,
        max_model_len=1024, max_num_seqs=max(c for c, _ in CALIBRATION), enforce_eager=v.enforce_eager, seed=0,
        sleep=False, kv_cache_space_gib=v.kv_cache_space_gib, distributed=False, block_size=v.block_size,
        multi_turn=False, cpu=True))

    def ask(c: int, n: int) -> None:
        sizes = split(c, group)
        llm.generate([{"prompt_token_ids": prompt}] * len(sizes), [vllm.SamplingParams(
            n=k, max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, seed=i, logprobs=0,
            detokenize=False) for i, k in enumerate(sizes)], use_tqdm=False)

    ask(1, 4)  # warm-up
    times = [min(timed(lambda c=c, n=n: ask(c, n)) for _ in range(repeats)) for c, n in CALIBRATION]
    return {**fit_decode(times, len(prompt)), "group": group, "engine": "in-process vllm.LLM"}


if __name__ == "__main__":  # calibrate_in_process's subprocess: CKPT PROMPT_JSON GROUP
    print(json.dumps(_llm_calibration(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))), flush=True)


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
    taskset = own_core(trainer_core)
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
    """Medians over the arm's runs (seeds) of: trained completion tokens/s and step time (median and mean) over the
    steps after `skip`, engine idle fraction, train seconds per token, sync seconds; the reward of every step per
    run."""
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
                    "step_mean_s": step / len(rows),
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
