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


def serve_batch(message: dict, handle) -> None:
    """In a worker: answer `message` (one request, or `{"batch": [requests]}` from `WorkerPool.call_many`) with one
    JSON line per request, `handle(request)` → reply dict, flushed as each is done."""
    for request in message["batch"] if "batch" in message else [message]:
        sys.stdout.write(json.dumps(handle(request)) + "\n")
        sys.stdout.flush()


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

    def _take(self) -> subprocess.Popen:
        with self.lock:
            proc = self.idle.pop() if self.idle else None
        return proc or self._start()

    def _give_back(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.idle.append(proc)

    @staticmethod
    def _send(proc: subprocess.Popen, message: dict) -> bool:
        try:
            proc.stdin.write(json.dumps(message) + "\n")
            proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    @staticmethod
    def _reply(proc: subprocess.Popen, timeout: float) -> tuple[dict | None, str]:
        """The worker's next reply line within `timeout`: (reply, `ok`), (None, `timeout`) or (None, `died`). Read
        from the pipe's descriptor into the worker's own buffer, so that lines already read stay visible to the next
        call (a buffered file object would hide them from `select`)."""
        buf: bytearray = proc.__dict__.setdefault("_grpo_buffer", bytearray())
        deadline = time.monotonic() + timeout
        fd = proc.stdout.fileno()
        while b"\n" not in buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None, "timeout"
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None, "died"
            buf += chunk
        end = buf.index(b"\n")
        line = bytes(buf[:end])
        del buf[:end + 1]
        return json.loads(line), "ok"

    def call(self, request: dict, timeout: float) -> tuple[dict | None, str]:
        """(reply, outcome): outcome `ok`, `timeout` (the group was killed) or `died` (no reply: the worker exited or
        was killed by a limit; it is replaced). The timeout counts from the moment a worker takes the call."""
        with self.slots:
            proc = self._take()
            reply, outcome = self._reply(proc, timeout) if self._send(proc, request) else (None, "died")
            if outcome == "ok":
                self._give_back(proc)
            else:
                self._kill(proc)
            return reply, outcome

    def call_many(self, requests: list[dict], timeout: float) -> list[tuple[dict | None, str]]:
        """`call` for each of `requests`, with one worker and one message for all (`{"batch": [...]}`: the worker
        answers one line per request as it finishes it, see `serve_batch`), which saves a round trip per request.
        Each request gets `timeout` from the previous reply (the first from the send), as if called alone; one
        past it kills the worker's group and is `timeout`, one the worker died on is `died`, and the requests after
        it go to a fresh worker."""
        out: list[tuple[dict | None, str]] = []
        while len(out) < len(requests):
            rest = requests[len(out):]
            with self.slots:
                proc = self._take()
                if not self._send(proc, {"batch": rest}):
                    self._kill(proc)
                    out.append((None, "died"))
                    continue
                for _ in rest:
                    reply, outcome = self._reply(proc, timeout)
                    out.append((reply, outcome))
                    if outcome != "ok":
                        self._kill(proc)
                        break
                else:
                    self._give_back(proc)
        return out

    def close(self) -> None:
        with self.lock:
            procs, self.live, self.idle = list(self.live), set(), []
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
