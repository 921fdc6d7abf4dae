"""Running a turn's tool calls: concurrently across the batch, each under `agent.tool_timeout_s`, inline (a thread)
or isolated (a separate interpreter of `WorkerPool`, killed at the timeout). Every failure becomes the text the
model reads next."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from grpo_cli.agent.inline import InlinePool
from grpo_cli.agent.tools import Tool, ToolCall
from grpo_cli.runtime.workers import WorkerPool


def format_result(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _check(call: ToolCall, tools: dict[str, Tool]) -> str | None:
    """The error text of a call that cannot run (bad JSON, unknown tool, arguments the signature refuses)."""
    if call.arguments is None:
        return f"error: {call.error}"
    if call.name not in tools:
        return f"error: unknown tool {call.name!r}; available: {', '.join(tools)}"
    try:
        tools[call.name].bind(call.arguments)
    except TypeError as exc:
        return f"error: bad arguments for {call.name}: {exc}"
    return None


_POOL: WorkerPool | None = None
POOL_SIZE = 8
"""Tool interpreters at most per trainer process."""
_INLINE = InlinePool()
_DISPATCH = ThreadPoolExecutor(max_workers=POOL_SIZE, thread_name_prefix="tool-dispatch")
"""Threads that wait on the tool interpreters' replies (process isolation), started once."""


FAST_CALL_S = 1e-3
"""A tool call taking less than this (interpreter round trip included) is fast: a turn's calls then go to as many
interpreters as there are CPUs, not `POOL_SIZE` (8 interpreters waking for 16 quick calls each cost ~13 ms per 128
calls on 2 CPUs, 2 interpreters ~2.5 ms); slow calls (I/O, unknown at first) get every interpreter."""
_CALL_S: list[float] = []
"""The last turn's seconds per call (process isolation), for `_interpreters`."""


def _interpreters(calls: int) -> int:
    fast = bool(_CALL_S) and _CALL_S[-1] < FAST_CALL_S
    return max(1, min(calls, POOL_SIZE, (os.cpu_count() or 1) if fast else POOL_SIZE))


def _in_process(pairs: list[tuple[Tool, ToolCall]], timeout: float) -> list[tuple[str, bool]]:
    """(text, timed out) per (tool, call), all sent to one tool interpreter in one message (`call_many`)."""
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool("grpo_cli.agent.tool_worker", POOL_SIZE)
    replies = _POOL.call_many([{"spec": tool.spec, "name": call.name, "arguments": call.arguments}
                               for tool, call in pairs], timeout)
    out = []
    for (_, call), (reply, outcome) in zip(pairs, replies, strict=True):
        if outcome == "timeout":
            out.append((_timed_out(call.name, timeout), True))
        elif reply is None:
            out.append((f"error: {call.name} died without a result", False))
        else:
            out.append((reply["text"] if reply["status"] == "ok" else f"error: {reply['text']}", False))
    return out


def _outcome(text: str, timed_out: bool) -> tuple[str, str]:
    return text, "timeout" if timed_out else "error" if text.startswith("error:") else "ok"


def _timed_out(name: str, timeout: float) -> str:
    return f"error: {name} timed out after {timeout:g} s"


def run_calls(calls: list[ToolCall], tools: dict[str, Tool] | list[dict[str, Tool]], *, timeout: float,
              isolation: str) -> list[tuple[str, str]]:
    """(result text, outcome) per call, outcome ∈ ok | error | timeout; the calls run concurrently (inline: on
    `InlinePool`'s threads; process: on the interpreters of `WorkerPool`, at most `POOL_SIZE` at once, each sent
    its share of the calls in one message and answering them one by one, each call under its own timeout). `tools` is
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
        share = -(-len(runnable) // _interpreters(len(runnable)))  # calls per interpreter, one message each
        chunks = [runnable[k:k + share] for k in range(0, len(runnable), share)] if runnable else []
        start = time.perf_counter()
        futures = [_DISPATCH.submit(_in_process, [(per_call[i][calls[i].name], calls[i]) for i in chunk], timeout)
                   for chunk in chunks]
        for chunk, future in zip(chunks, futures, strict=True):
            for i, result in zip(chunk, future.result(), strict=True):
                out[i] = _outcome(*result)
        if chunks:
            _CALL_S[:] = [(time.perf_counter() - start) * len(chunks) / len(runnable)]
        return out

    def job(call: ToolCall, tool: Tool):
        return lambda: format_result(tool.fn(**call.arguments))

    results = _INLINE.run([job(calls[i], per_call[i][calls[i].name]) for i in runnable], timeout)
    for i, (text, late) in zip(runnable, results, strict=True):
        out[i] = _outcome(_timed_out(calls[i].name, timeout) if late else text, late)
    return out
