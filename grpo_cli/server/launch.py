"""Start `grpo serve-rollout`: bind the port first (so `--port 0` picks a free one and a clash is named), load
the engine, serve with uvicorn, and print `listening on URL` once requests are accepted. `--engine sglang`
instead runs `python -m sglang.launch_server` as a supervised child process."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

from grpo_cli.runtime.faults import FaultPlan
from grpo_cli.server.engines import ServeError, ServeOptions

READY_PREFIX = "grpo serve-rollout: listening on "


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror} (pick another --port, or --port 0 "
                         "for a free one)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def wait_ready_line(proc, timeout_s: float, sink) -> str | None:
    """The URL of a server child's `listening on URL` line, read within `timeout_s` (None if none came); a thread
    keeps passing every line of its stdout to `sink(line)` until it exits."""
    import threading

    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            sink(line)
            if line.startswith(READY_PREFIX) and not found:
                found.append(line[len(READY_PREFIX):].split()[0])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    ready.wait(timeout_s)
    return found[0] if found else None


def _say(message: str) -> None:
    print(message, flush=True)


def run_reward_server(opts: ServeOptions) -> None:
    """`--task reward`: serve `opts.model` (a sequence-classification checkpoint) on /classify until stopped."""
    import uvicorn

    from grpo_cli.server.reward_app import create_reward_app

    sock = bind(opts.host, opts.port)
    url = url_of(sock)
    app = create_reward_app(opts.model, token=opts.token, max_request_bytes=int(opts.max_request_mb * 2**20),
                            on_startup=lambda: _say(f"{READY_PREFIX}{url} (reward model {opts.model})"))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, lifespan="on")).run(sockets=[sock])


def run_server(opts: ServeOptions) -> None:
    """Serve until SIGINT/SIGTERM. Raises ServeError for user errors (bad model, port in use, missing package)."""
    from grpo_cli.server.engines import check_options

    faults = FaultPlan.from_env()
    if faults:
        _say(faults.banner())
    if opts.engine == "sglang" and faults.server_hang_step() is not None:
        raise ServeError("GRPO_INJECT_FAULT=server_hang is injected by grpo serve-rollout's own app (--engine hf or "
                         "vllm); an SGLang server answers by itself: rehearse with --engine hf, or unset it.")
    check_options(opts)
    if opts.engine == "sglang":
        return run_sglang(opts)
    sock = bind(opts.host, opts.port)
    url = url_of(sock)
    if opts.host not in ("127.0.0.1", "localhost", "::1") and not opts.token:
        _say(f"warning: listening on {opts.host} without a token: anyone who can reach it can replace the "
             "weights; set the variable named by --token-env")
    import uvicorn

    from grpo_cli.server.app import create_app
    from grpo_cli.server.engines import build, with_nccl

    served = with_nccl(build(opts))
    app = create_app(served, token=opts.token, max_request_bytes=int(opts.max_request_mb * 2**20),
                     max_frame_bytes=int(opts.max_frame_mb * 2**20), hang_from_step=faults.server_hang_step(),
                     on_startup=lambda: _say(f"{READY_PREFIX}{url} (engine {opts.engine}, model {opts.model})"))
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


def sglang_command(opts: ServeOptions, *, python: str = sys.executable) -> list[str]:
    """The `sglang.launch_server` command for these options (the token is appended by run_sglang). The trainer
    seeds every rollout, and SGLang honours `sampling_seed` only with `--enable-deterministic-inference`
    (`srt/sampling/sampling_batch_info.py`), so it is always on: reproducible rollouts, at some throughput."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", opts.model, "--host", opts.host,
           "--port", str(opts.port), "--tp-size", str(opts.tensor_parallel_size),
           "--mem-fraction-static", str(opts.gpu_memory_utilization), "--random-seed", str(opts.seed),
           "--enable-deterministic-inference"]
    if opts.dtype != "auto":
        cmd += ["--dtype", opts.dtype]
    if opts.max_model_len:  # SGLang refuses a prompt + completion that reaches its context length: one more
        cmd += ["--context-length", str(opts.max_model_len + 1)]
    if opts.sleep_level:
        cmd += ["--enable-memory-saver"]
    return cmd + list(opts.extra_args)


def run_sglang(opts: ServeOptions, *, ready_timeout_s: float = 1800.0) -> None:
    if importlib.util.find_spec("sglang") is None:
        raise ServeError("--engine sglang needs the sglang package (pip install 'grpo-cli[sglang]', CUDA only); "
                         "or start an SGLang server yourself and point rollout.server.urls at it")
    from grpo_cli.rollout.sglang.client import MIN_VERSION, parse_version

    installed = importlib.metadata.version("sglang")
    if (parse_version(installed) or MIN_VERSION) < MIN_VERSION:
        raise ServeError(f"--engine sglang needs sglang >= {'.'.join(map(str, MIN_VERSION))}, this environment has "
                         f"{installed}: pip install -U 'grpo-cli[sglang]'")
    if opts.port == 0:
        with socket.socket() as s:
            s.bind((opts.host, 0))
            opts = dataclasses.replace(opts, port=s.getsockname()[1])
    env = dict(os.environ)
    cmd = sglang_command(opts)
    if opts.token:  # SGLang reads --api-key; pass it on the command line of the child only
        cmd += ["--api-key", opts.token]
    child = subprocess.Popen(cmd, env=env)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    url = f"http://{opts.host}:{opts.port}"
    if wait_sglang(child, url, ready_timeout_s):
        _say(f"{READY_PREFIX}{url} (engine sglang, model {opts.model}; SGLang native API)")
    code = child.wait()
    if code:
        raise ServeError(f"sglang.launch_server exited with code {code} (its log is above)")


def wait_sglang(child: subprocess.Popen, url: str, timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and child.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5.0, trust_env=False).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    return False
