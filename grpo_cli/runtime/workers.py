"""Pools of separate Python interpreters that serve JSON-line requests (`python -m MODULE`: one request per line on
stdin, one reply per line on stdout): tool calls (`agent`) and isolated reward functions (`rewards`). Each worker is
the leader of its own process group, so a call past its timeout is ended by killing the whole group (the worker
and anything it started; the next call starts a fresh worker), and a call that returns ends what it left running
(`end_strays`). Optional address-space limit and scrubbed environment. Not a security boundary: a worker runs as
the trainer's user."""

from __future__ import annotations

import atexit
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

KEEP_ENV = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT")
"""What a scrubbed worker environment keeps (imports must still work); HOME and TMPDIR point at a temp folder."""


def end_strays() -> None:
    """In a worker, after each call: SIGTERM to every other process of its group (what the call started and left
    running), the worker itself ignoring it for that moment; so each call ends with the processes it started."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(os.getpgrp(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


class WorkerPool:
    """At most `size` workers of `module` run at once; a call waits for a free one. `memory_mb` caps each worker's
    address space (RLIMIT_AS); `scrub_env` starts workers with `KEEP_ENV` only."""

    def __init__(self, module: str, size: int, *, memory_mb: int | None = None, scrub_env: bool = False) -> None:
        self.module, self.memory_mb, self.scrub_env = module, memory_mb, scrub_env
        self.idle: list[subprocess.Popen] = []
        self.slots = threading.Semaphore(size)
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()
        self.home = tempfile.mkdtemp(prefix="grpo-workers-")
        atexit.register(self.close)

    def _env(self) -> dict[str, str] | None:
        if not self.scrub_env:
            return None
        env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
        return {**env, "HOME": self.home, "TMPDIR": self.home, "PYTHONPATH": os.pathsep.join(
            p for p in [os.getcwd(), env.get("PYTHONPATH", "")] if p)}

    def _limits(self) -> None:  # in the child, before exec
        if self.memory_mb:
            size = self.memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", self.module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
                                env=self._env(), preexec_fn=self._limits if self.memory_mb else None)
        with self.lock:
            self.live.add(proc)
        return proc

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        with self.lock:
            self.live.discard(proc)

    def call(self, request: dict, timeout: float) -> tuple[dict | None, str]:
        """(reply, outcome): outcome `ok`, `timeout` (the group was killed) or `died` (no reply: the worker exited or
        was killed by a limit; it is replaced). The timeout counts from the moment a worker takes the call."""
        with self.slots:
            with self.lock:
                proc = self.idle.pop() if self.idle else None
            proc = proc or self._start()
            deadline, ready, line = time.monotonic() + timeout, [], ""
            try:
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = proc.stdout.readline() if ready else ""
            except (BrokenPipeError, OSError):
                ready = [True]
            if not ready:
                self._kill(proc)
                return None, "timeout"
            if not line:
                self._kill(proc)
                return None, "died"
            with self.lock:
                self.idle.append(proc)
            return json.loads(line), "ok"

    def close(self) -> None:
        with self.lock:
            procs, self.live, self.idle = list(self.live), set(), []
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
