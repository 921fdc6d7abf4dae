"""`grpo serve-rollout --data-parallel-size N` / `--gpus all`: one engine process per GPU (or per tensor-parallel
group) on consecutive ports, each its own URL in the trainer's pool, started and stopped together."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

from grpo_cli.server.engines import ServeError, ServeOptions

_NOT_FORWARDED = ("token", "extra_args", "port")  # the token travels in the environment; each child gets its port


def engine_devices(index: int, tensor_parallel: int, gpus: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of engine `index` (its tensor-parallel group of GPUs); None on a machine without GPUs."""
    if gpus == 0:
        return None
    return ",".join(str(index * tensor_parallel + k) for k in range(tensor_parallel))


def fleet_size(data_parallel_size: int | None, all_gpus: bool, tensor_parallel: int, gpus: int) -> int:
    """Engines to start: `--data-parallel-size`, or every GPU's tensor-parallel group with `--gpus all`."""
    if all_gpus:
        if gpus == 0:
            raise ServeError("--gpus all starts one engine per GPU, and this machine has no CUDA GPU; on CPU give "
                             "--data-parallel-size N (N CPU engines on consecutive ports) or drop the option.")
        if gpus % tensor_parallel:
            raise ServeError(f"--gpus all: --tensor-parallel-size {tensor_parallel} must divide this machine's "
                             f"{gpus} GPUs.")
        return gpus // tensor_parallel
    n = data_parallel_size or 1
    if gpus and n * tensor_parallel > gpus:
        raise ServeError(f"--data-parallel-size {n} x --tensor-parallel-size {tensor_parallel} needs "
                         f"{n * tensor_parallel} GPUs; this machine has {gpus}.")
    return n


def child_argv(opts: ServeOptions, port: int, token_env: str) -> list[str]:
    """The `grpo serve-rollout` command of one engine of the fleet (the same options, its own port)."""
    argv = [sys.executable, "-m", "grpo_cli.cli.serve", "--port", str(port), "--token-env", token_env]
    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        if f.name in _NOT_FORWARDED or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        argv += ([flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)])
    return argv


def cuda_gpus() -> int:
    """GPUs this machine shows (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_fleet(opts: ServeOptions, n: int, *, token_env: str, gpus: int) -> int:
    """Start `n` engines on ports opts.port .. opts.port + n - 1, wait until one ends or a signal comes, stop all."""
    if opts.port == 0:
        raise ServeError("--data-parallel-size > 1 needs a fixed --port (the engines listen on --port, --port + 1, "
                         "...; the trainer's URLs are derived from it).")
    procs = []
    for i in range(n):
        env = dict(os.environ)
        devices = engine_devices(i, opts.tensor_parallel_size, gpus)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        procs.append(subprocess.Popen(child_argv(opts, opts.port + i, token_env), env=env))
        print(f"engine {i}: http://{opts.host}:{opts.port + i}" + (f" (GPUs {devices})" if devices else ""),
              flush=True)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    code = 0
    while not stop:
        done = [p.returncode for p in procs if p.poll() is not None]
        if done:
            code = done[0] or 1  # an engine that ends is a failure of the node's servers
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    return code
