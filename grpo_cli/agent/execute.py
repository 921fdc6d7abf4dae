"""Running a turn's tool calls: concurrently across the batch, each under `agent.tool_timeout_s`, inline (a thread)
or isolated (a fresh process, killed at the timeout). Every failure becomes the text the model reads next."""

from __future__ import annotations

import json
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor

from grpo_cli.agent.tools import Tool, ToolCall


def _format(value) -> str:
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


def _child(conn, spec: str, name: str, arguments: dict) -> None:
    """Process entry: resolve the tool by its spec (nothing is pickled but names and JSON), run it, send back."""
    from grpo_cli.agent.tools import load_tools

    try:
        tool = next(t for t in load_tools([spec]).values() if t.name == name)
        conn.send(("ok", _format(tool.fn(**arguments))))
    except BaseException as exc:  # noqa: BLE001  (any failure is the model's next message)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _context():
    """Processes forked from a fork server that has imported this module once (a call then starts in milliseconds,
    and never inherits the trainer's threads, CUDA context or open files)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["grpo_cli.agent.execute"])
    return ctx


def _in_process(tool: Tool, call: ToolCall, timeout: float) -> tuple[str, bool]:
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, tool.spec, call.name, call.arguments), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            return f"error: {call.name} timed out after {timeout:g} s", True
        status, text = parent.recv()
        return (text if status == "ok" else f"error: {text}"), False
    except EOFError:
        return f"error: {call.name} died without a result (exit code {proc.exitcode})", False
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        parent.close()


def _in_thread(tool: Tool, call: ToolCall, timeout: float) -> tuple[str, bool]:
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = _format(tool.fn(**call.arguments))
        except Exception as exc:  # noqa: BLE001
            box["out"] = f"error: {type(exc).__name__}: {exc}"

    worker = threading.Thread(target=run, daemon=True, name=f"tool-{call.name}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return f"error: {call.name} timed out after {timeout:g} s", True
    return box["out"], False


def run_calls(calls: list[ToolCall], tools: dict[str, Tool], *, timeout: float, isolation: str
              ) -> list[tuple[str, str]]:
    """(result text, outcome) per call, outcome ∈ ok | error | timeout; the calls run concurrently."""
    def one(call: ToolCall) -> tuple[str, str]:
        problem = _check(call, tools)
        if problem is not None:
            return problem, "error"
        runner = _in_process if isolation == "process" else _in_thread
        text, timed_out = runner(tools[call.name], call, timeout)
        return text, "timeout" if timed_out else "error" if text.startswith("error:") else "ok"

    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(calls))) as pool:
        return list(pool.map(one, calls))
