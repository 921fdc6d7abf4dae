"""Running a turn's tool calls: concurrently across the batch, each under `agent.tool_timeout_s`, inline (a thread)
or isolated (a separate interpreter of `WorkerPool`, killed at the timeout). Every failure becomes the text the
model reads next."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from grpo_cli.agent.inline import InlinePool
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
_INLINE = InlinePool()
_DISPATCH = ThreadPoolExecutor(max_workers=POOL_SIZE, thread_name_prefix="tool-dispatch")
"""Threads that wait on the tool interpreters' replies (process isolation), started once."""


def _in_process(tool: Tool, call: ToolCall, timeout: float) -> tuple[str, bool]:
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool("grpo_cli.agent.tool_worker", POOL_SIZE)
    reply, outcome = _POOL.call({"spec": tool.spec, "name": call.name, "arguments": call.arguments}, timeout)
    if outcome == "timeout":
        return _timed_out(call.name, timeout), True
    if reply is None:
        return f"error: {call.name} died without a result", False
    return (reply["text"] if reply["status"] == "ok" else f"error: {reply['text']}"), False


def _outcome(text: str, timed_out: bool) -> tuple[str, str]:
    return text, "timeout" if timed_out else "error" if text.startswith("error:") else "ok"


def _timed_out(name: str, timeout: float) -> str:
    return f"error: {name} timed out after {timeout:g} s"


def run_calls(calls: list[ToolCall], tools: dict[str, Tool] | list[dict[str, Tool]], *, timeout: float,
              isolation: str) -> list[tuple[str, str]]:
    """(result text, outcome) per call, outcome ∈ ok | error | timeout; the calls run concurrently (inline: on
    `InlinePool`'s threads; process: on the interpreters of `WorkerPool`, at most `POOL_SIZE` at once). `tools` is
    one set for every call, or one per call (an environment's bound methods: each trajectory has its own
    instance)."""
    per_call = tools if isinstance(tools, list) else [tools] * len(calls)
    out: list[tuple[str, str] | None] = [None] * len(calls)
    runnable = []
    for i, (call, available) in enumerate(zip(calls, per_call, strict=True)):
        problem = _check(call, available)
        if problem is not None:
            out[i] = (problem, "error")
        else:
            runnable.append(i)
    if isolation == "process":
        futures = [_DISPATCH.submit(_in_process, per_call[i][calls[i].name], calls[i], timeout) for i in runnable]
        for i, future in zip(runnable, futures, strict=True):
            out[i] = _outcome(*future.result())
        return out

    def job(call: ToolCall, tool: Tool):
        return lambda: format_result(tool.fn(**call.arguments))

    results = _INLINE.run([job(calls[i], per_call[i][calls[i].name]) for i in runnable], timeout)
    for i, (text, late) in zip(runnable, results, strict=True):
        out[i] = _outcome(_timed_out(calls[i].name, timeout) if late else text, late)
    return out
