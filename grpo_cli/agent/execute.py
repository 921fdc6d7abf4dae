"""Running a turn's tool calls: concurrently across the batch, each under `agent.tool_timeout_s`, inline (a thread)
or isolated (a separate interpreter of `WorkerPool`, killed at the timeout). Every failure becomes the text the
model reads next."""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from grpo_cli.agent.tools import Tool, ToolCall


def format_result(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _check(call: ToolCall, tools: dict[str, Tool]) -> str | None:
    """The error text of a call that cannot run (bad JSON, unknown tool, arguments the signature refuses)."""
    import inspect

    if call.arguments is None:
        return f"error: {call.error}"
    if call.name not in tools:
        return f"error: unknown tool {call.name!r}; available: {', '.join(tools)}"
    try:
        inspect.signature(tools[call.name].fn).bind(**call.arguments)
    except TypeError as exc:
        return f"error: bad arguments for {call.name}: {exc}"
    return None


class WorkerPool:
    """Tool interpreters (`agent.tool_worker`), started on demand and reused: at most `size` run at once, a call
    waits for a free one. A worker whose call passes the timeout is killed (its call answered with a timeout) and
    replaced by a fresh one at the next call; all are killed when the trainer exits."""

    def __init__(self, size: int) -> None:
        self.idle: list[subprocess.Popen] = []
        self.slots = threading.Semaphore(size)
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()
        atexit.register(self.close)

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "grpo_cli.agent.tool_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        with self.lock:
            self.live.add(proc)
        return proc

    def _kill(self, proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        with self.lock:
            self.live.discard(proc)

    def call(self, tool: Tool, call: ToolCall, timeout: float) -> tuple[str, bool]:
        """(result text, timed out); the timeout counts from the moment a worker takes the call."""
        with self.slots:
            with self.lock:
                proc = self.idle.pop() if self.idle else None
            proc = proc or self._start()
            deadline = time.monotonic() + timeout
            ready = []
            try:
                proc.stdin.write(json.dumps({"spec": tool.spec, "name": call.name, "arguments": call.arguments})
                                 + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = proc.stdout.readline() if ready else ""
            except (BrokenPipeError, OSError):
                line = ""
            if not ready:
                self._kill(proc)
                return f"error: {call.name} timed out after {timeout:g} s", True
            if not line:
                self._kill(proc)
                return f"error: {call.name} died without a result (exit code {proc.poll()})", False
            with self.lock:
                self.idle.append(proc)
            reply = json.loads(line)
            return (reply["text"] if reply["status"] == "ok" else f"error: {reply['text']}"), False

    def close(self) -> None:
        with self.lock:
            procs, self.live, self.idle = list(self.live), set(), []
        for proc in procs:
            proc.kill()
            proc.wait()


_POOL: WorkerPool | None = None
POOL_SIZE = 8
"""Tool interpreters at most per trainer process."""


def _in_process(tool: Tool, call: ToolCall, timeout: float) -> tuple[str, bool]:
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool(POOL_SIZE)
    return _POOL.call(tool, call, timeout)


def _in_thread(tool: Tool, call: ToolCall, timeout: float) -> tuple[str, bool]:
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = format_result(tool.fn(**call.arguments))
        except Exception as exc:  # noqa: BLE001
            box["out"] = f"error: {type(exc).__name__}: {exc}"

    worker = threading.Thread(target=run, daemon=True, name=f"tool-{call.name}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return f"error: {call.name} timed out after {timeout:g} s", True
    return box["out"], False


def run_calls(calls: list[ToolCall], tools: dict[str, Tool] | list[dict[str, Tool]], *, timeout: float,
              isolation: str) -> list[tuple[str, str]]:
    """(result text, outcome) per call, outcome ∈ ok | error | timeout; the calls run concurrently. `tools` is one
    set for every call, or one per call (an environment's bound methods: each trajectory has its own instance)."""
    per_call = tools if isinstance(tools, list) else [tools] * len(calls)

    def one(item: tuple[ToolCall, dict[str, Tool]]) -> tuple[str, str]:
        call, available = item
        problem = _check(call, available)
        if problem is not None:
            return problem, "error"
        runner = _in_process if isolation == "process" else _in_thread
        text, timed_out = runner(available[call.name], call, timeout)
        return text, "timeout" if timed_out else "error" if text.startswith("error:") else "ok"

    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(calls))) as pool:
        return list(pool.map(one, zip(calls, per_call, strict=True)))
