"""Running a turn's tool calls: concurrently across the batch, each under `agent.tool_timeout_s`, inline (a thread)
or isolated (a separate interpreter of `WorkerPool`, killed at the timeout). Every failure becomes the text the
model reads next."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

from grpo_cli.agent.tools import Tool, ToolCall
from grpo_cli.runtime.workers import WorkerPool


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


_POOL: WorkerPool | None = None
POOL_SIZE = 8
"""Tool interpreters at most per trainer process."""


def _in_process(tool: Tool, call: ToolCall, timeout: float) -> tuple[str, bool]:
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool("grpo_cli.agent.tool_worker", POOL_SIZE)
    reply, outcome = _POOL.call({"spec": tool.spec, "name": call.name, "arguments": call.arguments}, timeout)
    if outcome == "timeout":
        return f"error: {call.name} timed out after {timeout:g} s", True
    if reply is None:
        return f"error: {call.name} died without a result", False
    return (reply["text"] if reply["status"] == "ok" else f"error: {reply['text']}"), False


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
