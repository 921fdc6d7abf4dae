"""The `agent:` config section: multi-turn tool calling during rollouts (off unless set)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_cli.config.base import Section


class AgentConfig(Section):
    tools: list[str] = Field(default_factory=list)
    """Tool functions, as reward functions are named: `pkg.module:function` or `path/file.py:function` (built in:
    `calculator`). Each function's type hints and docstring give the JSON schema the chat template shows the model
    (`tools=`)."""
    environment: str | None = None
    """`pkg.module:Class` or `path/file.py:Class`: one instance per rollout, `reset(**row)` gets the prompt's dataset
    row (its other columns), its public methods are tools beside `tools` (their state lives in the trainer, so
    they run inline), an optional `reward()` is what the reward function `grpo_cli.agent.rewards:environment`
    returns."""
    max_turns: int = Field(4, ge=1)
    """Most assistant turns per rollout; a trajectory that still calls a tool after the last turn stops there."""
    tool_parser: str = "hermes"
    """How tool calls are read from a turn's text: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`, the format Qwen's templates use) or `pkg.module:function` (text → list of (name, arguments))."""
    max_tool_output_tokens: int = Field(64, ge=1)
    """A tool result longer than this many tokens is cut to it (the model sees `…` at the cut)."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """A call still running after this long is stopped and answered with a timeout error; the run goes on."""
    tool_isolation: Literal["inline", "process"] = "process"
    """`process`: calls run in separate Python interpreters (a pool of up to 8 per trainer process, reused; one
    whose call passes the timeout is killed and replaced; nothing shared with the trainer but JSON lines);
    `inline`: in a thread of the trainer (no interpreter start; a call that hangs keeps its thread)."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's own (one that renders `tools` and tool messages and
    keeps earlier turns unchanged when a turn is added)."""

    @model_validator(mode="after")
    def _tools_or_environment(self) -> AgentConfig:
        if not self.tools and self.environment is None:
            raise ValueError("agent needs tools (agent.tools: [pkg.module:function, ...]) or an environment "
                             "(agent.environment: pkg.module:Class); set one, or agent: null for single turns.")
        if self.environment is not None and self.tool_isolation == "process":
            raise ValueError("agent.environment's methods keep their state in the trainer process, so they cannot "
                             "run isolated: set agent.tool_isolation: inline (tools then run in threads too).")
        return self
