"""The chat template's part in a multi-turn rollout: the tokens it puts around a tool result (found as the
difference of two renderings, so sampled ids are never decoded and re-encoded), and the config-time checks that it
renders tools and keeps earlier turns unchanged when a turn is added (prefix-preserving)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.agent.tools import ToolError

MARK = "\u2063RESULT\u2063"
"""A placeholder no template escapes or splits; the result's own tokens replace it."""
_PROBE = [{"role": "user", "content": "what is two plus three ?"}]
_TURN = "let me check"
_LATER = "five"


def _render(tokenizer, messages, *, template: str | None, tools: list[dict], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation,
                                         chat_template=template)


@dataclass(frozen=True)
class ToolFraming:
    """`before + result + after` is what follows an assistant turn's end-of-turn token when a tool answers: the
    tool message and the next assistant header (`add_generation_prompt`)."""

    before: list[int]
    after: list[int]

    def tokens(self, tokenizer, result_ids: list[int]) -> list[int]:
        return [*self.before, *result_ids, *self.after]


def tool_framing(tokenizer, *, template: str | None, tools: list[dict], end_of_turn: str) -> ToolFraming:
    """Render [user, assistant] and [user, assistant, tool(MARK)] + generation prompt; the second must extend the
    first cut after its last `end_of_turn` (where a sampled turn stops); the rest, split at MARK, is tokenised once.
    Raises ToolError naming `agent.chat_template` when the template drops tools or rewrites earlier turns."""
    turn = [*_PROBE, {"role": "assistant", "content": _TURN}]
    base = _render(tokenizer, turn, template=template, tools=tools, generation=False)
    full = _render(tokenizer, [*turn, {"role": "tool", "content": MARK}], template=template, tools=tools,
                   generation=True)
    cut = base.rfind(end_of_turn)
    if cut < 0 or MARK not in full:
        raise ToolError("the chat template does not render tool messages (no tool result appears in its output); "
                        "set agent.chat_template to one that does (a ChatML template with a `tool` role).")
    base = base[: cut + len(end_of_turn)]
    if not full.startswith(base):
        raise ToolError(_NOT_PREFIX)
    before, after = full[len(base):].split(MARK)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return ToolFraming(encode(before) if before else [], encode(after) if after else [])


_NOT_PREFIX = ("the chat template is not prefix-preserving: rendering a conversation with one more turn changes the "
               "text of the earlier turns (templates that drop earlier <think> blocks do), so the ids sampled in a "
               "turn would not be the ids the trainer sees. Set agent.chat_template to a template that keeps "
               "earlier turns verbatim.")


def check_template(tokenizer, *, template: str | None, tools: list[dict]) -> None:
    """The template shows the tools, and a rendering of k turns is a prefix of the rendering of k + 1."""
    shown = _render(tokenizer, _PROBE, template=template, tools=tools, generation=True)
    if tools and tools[0]["function"]["name"] not in shown:
        raise ToolError("the chat template does not render `tools` (the model would never see the tool schemas); "
                        "set agent.chat_template to one that does.")
    first = [*_PROBE, {"role": "assistant", "content": "<think>hmm</think>" + _TURN},
             {"role": "tool", "content": "5"}]
    second = [*first, {"role": "assistant", "content": _LATER}]
    one = _render(tokenizer, first, template=template, tools=tools, generation=True)
    two = _render(tokenizer, second, template=template, tools=tools, generation=False)
    if not two.startswith(one):
        raise ToolError(_NOT_PREFIX)
