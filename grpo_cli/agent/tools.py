"""Tools: typed Python functions named like reward functions, their JSON schemas (from type hints and the
docstring) for the chat template, and the parsers that read tool calls out of a turn's text."""

from __future__ import annotations

import functools
import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass

from grpo_cli.config.errors import UserError
from grpo_cli.rewards.resolve import resolve

JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@functools.lru_cache(maxsize=256)
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


class ToolError(UserError):
    """A tool or parser that cannot be used as configured (the message names it and the fix)."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    spec: str
    """Where it came from (`pkg.module:function`), for messages."""

    def bind(self, arguments: dict) -> None:
        """Raise TypeError if `fn(**arguments)` does not fit its signature (read once per function: an
        environment's bound methods share their function's, with `self` bound)."""
        func = getattr(self.fn, "__func__", None)
        if func is None:
            _signature(self.fn).bind(**arguments)
        else:
            _signature(func).bind(self.fn.__self__, **arguments)

    def schema(self) -> dict:
        """OpenAI-style function schema: name, the docstring's first paragraph, one property per parameter with its
        JSON type (from the type hint) and its `name: text` line of the docstring, every parameter without a
        default required."""
        hints = typing.get_type_hints(self.fn)
        doc = inspect.getdoc(self.fn) or ""
        described = dict(re.findall(r"^\s*(\w+)\s*(?:\([^)]*\))?:\s*(.+)$", doc, re.M))
        props, required = {}, []
        for name, param in inspect.signature(self.fn).parameters.items():
            if name == "self":  # an environment's method, read from its class
                continue
            kind = JSON_TYPES.get(typing.get_origin(hints.get(name)) or hints.get(name), "string")
            props[name] = {"type": kind, **({"description": described[name]} if name in described else {})}
            if param.default is inspect.Parameter.empty:
                required.append(name)
        summary = doc.split("\n\n")[0].replace("\n", " ").strip()
        return {"type": "function", "function": {"name": self.name, "description": summary, "parameters": {
            "type": "object", "properties": props, "required": required}}}


def calculator(a: int, b: int) -> int:
    """Add two whole numbers.

    a: the first number
    b: the second number
    """
    return a + b


BUILTIN_TOOLS = {"calculator": calculator}


def resolve_callable(spec: str) -> Callable:
    from grpo_cli.rewards.resolve import RewardError

    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    try:
        return resolve(spec)
    except RewardError as exc:
        raise ToolError(f"agent.tools: {str(exc).replace('reward ', 'tool ', 1)}") from None


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """Resolve `agent.tools` (built-in `calculator`, `pkg.module:function`, `path/file.py:function`); every tool
    needs type hints on its parameters (the schema is built from them)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        fn = resolve_callable(spec)
        name = fn.__name__
        untyped = [p for p in inspect.signature(fn).parameters if p not in typing.get_type_hints(fn) and p != "self"]
        if untyped:
            raise ToolError(f"agent.tools: {spec} has parameters without type hints ({', '.join(untyped)}); the "
                            "model is shown a JSON schema built from them: annotate them (e.g. `a: int`).")
        if name in tools:
            raise ToolError(f"agent.tools: two tools are named {name!r} ({tools[name].spec}, {spec}); rename one.")
        tools[name] = Tool(name, fn, spec)
    return tools


ENV_METHODS = ("reset", "reward")
"""An environment's methods that are not tools."""


def load_environment(spec: str) -> type:
    """The environment class of `agent.environment` (a class with `reset(**row)`)."""
    cls = resolve_callable(spec)
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
        raise ToolError(f"agent.environment: {spec} is not a class with a reset(**row) method.")
    return cls


def environment_tools(env, spec: str) -> dict[str, Tool]:
    """An environment's public methods but `reset`/`reward`, as tools: bound to `env` (an instance: calls change
    its state) or, given the class, unbound (for the schemas shown in the prompt)."""
    names = [n for n, f in inspect.getmembers(env if isinstance(env, type) else type(env), inspect.isfunction)
             if not n.startswith("_") and n not in ENV_METHODS]
    tools = {n: Tool(n, getattr(env, n), f"{spec}.{n}") for n in names}
    for tool in tools.values():
        hints = typing.get_type_hints(tool.fn)
        untyped = [p for p in inspect.signature(tool.fn).parameters if p not in hints and p != "self"]
        if untyped:
            raise ToolError(f"agent.environment: {tool.spec} has parameters without type hints ({', '.join(untyped)})"
                            "; annotate them (the model is shown a JSON schema built from them).")
    return tools


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict | None
    """None when the call's JSON could not be read (`error` says why)."""
    error: str = ""


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block of `text`, in order; a block whose
    JSON does not parse (or lacks a name) is a call with an error, answered as such."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            data = json.loads(body)
            name, args = data["name"], data.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ToolCall(name, args))
        except (ValueError, KeyError, TypeError) as exc:
            calls.append(ToolCall("", None, f"the tool call is not valid JSON of the form {{\"name\": ..., "
                                            f"\"arguments\": {{...}}}}: {exc}"))
    return calls


def load_parser(spec: str) -> Callable[[str], list[ToolCall]]:
    """`hermes`, or a user function `text -> [(name, arguments), ...]` wrapped to return `ToolCall`s."""
    if spec == "hermes":
        return parse_hermes
    fn = resolve(spec)

    def parse(text: str) -> list[ToolCall]:
        return [ToolCall(name, args) for name, args in fn(text)]

    return parse
