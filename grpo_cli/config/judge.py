"""Generative judge rewards (`rewards.functions` entries `{judge: URL_OR_PATH, prompt: FILE, ...}`): the settings of
one judge, their defaults, and the checks that refuse a judge that could not work (a missing or unreadable prompt
file, a template that never shows the completion, a regex without its number group)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from grpo_cli.config.base import Section

JUDGE = "judge"
"""The built-in reward function behind `{judge: URL_OR_PATH, prompt: FILE}`."""

FUNCTION_FORM = re.compile(r"^[^\s()\[\]{}|*+?^$\\]+:[A-Za-z_]\w*$")
"""`pkg.mod:function` or `path/to/file.py:function` (no regex syntax in it)."""


def is_url(target: str) -> bool:
    """A served judge (`http://`, `https://`); anything else is a local checkpoint (folder, hub or built-in name)."""
    return target.startswith(("http://", "https://"))


def parse_kind(parse: str) -> str:
    """`regex` (a pattern with exactly one capture group), or `function` (`pkg:function`, `file.py:function`).
    A pattern with a group is never taken for a function; anything else must look like one."""
    try:
        groups = re.compile(parse).groups
    except re.error:
        groups = -1
    if groups == 1:
        return "regex"
    if FUNCTION_FORM.match(parse):
        return "function"
    raise ValueError(
        f"parse {parse!r} is neither a regex with exactly one capture group (it has "
        f"{'no valid pattern' if groups < 0 else f'{groups} groups'}) around the number, e.g. 'Score: (\\d+)', nor "
        "a parser function 'pkg.module:function' / 'path/to/file.py:function' (text -> float or None).")


class JudgeConfig(Section):
    """One generative judge: where it runs, what it is asked, how its answer becomes a score."""

    judge: str = Field(min_length=1)
    """The judge model: `http(s)://host:port` of a server (see `api`), or a local checkpoint (a folder, a hub name
    or `builtin:tiny`) loaded once in the training process and run with transformers' `generate`."""
    prompt: str = Field(min_length=1)
    """A Jinja2 template file, rendered per completion with `completion`, `prompt` (the policy's prompt text),
    `prompt_messages` (a chat prompt's messages, else None) and every data column by name (e.g. `answer`). It must
    use `completion`. The result is sent as one user message."""
    parse: str = r"(-?\d+(?:\.\d+)?)"
    """How the judge's answer becomes a score: a regex with one capture group (the last match's group is the
    score; default: the last number in the answer), or a function `pkg.module:function` /
    `path/to/file.py:function` taking the answer text and returning a float or None. No match, a non-number or a
    function that raises: the completion's score is missing."""
    api: Literal["openai", "grpo"] = "openai"
    """For a URL: `openai` posts each judge prompt to `{url}/v1/chat/completions` (vLLM, SGLang, TGI, llama.cpp and
    hosted OpenAI-compatible servers), `grpo` posts token ids to a `grpo serve-rollout` server's `/generate` in
    batches of `batch_size`, rendered with the judge's tokenizer."""
    model: str | None = None
    """`api: openai`: the model name sent in each request (null: none sent; vLLM then uses its served model)."""
    tokenizer: str | None = None
    """`api: grpo`: the judge's tokenizer (a folder or name); null: the model the server reports on `/info`."""
    max_tokens: int = Field(64, ge=1)
    """Most tokens the judge may write per answer."""
    temperature: float = Field(0.0, ge=0)
    """The judge's sampling temperature; 0: greedy."""
    batch_size: int = Field(8, ge=1)
    """Completions judged at once: requests in flight (`api: openai`, one conversation per request), prompts per
    `/generate` request (`api: grpo`), or prompts per `generate` call (a local checkpoint)."""
    retries: int = Field(2, ge=0)
    """A request that times out, cannot connect or is answered 429 or 5xx is sent again up to this many times
    (after 0.5, 1, 2 s ...); then its completions score missing (counted in `judge/<name>/missing`)."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds one request (one try) may take."""
    token_env: str | None = None
    """An environment variable holding a bearer token sent to the server (e.g. `OPENAI_API_KEY`); null: none."""
    device: str = "cpu"
    """A local checkpoint: `cpu`, a device name (`cuda:0`) or `auto` (the training device). On an accelerator it is
    parked in host memory except while it judges when the rollout engine shares the training device (as a reward
    model: `config.reward_models.parks_reward_models`), and `grpo plan` counts it."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """A local checkpoint: the dtype it loads in; null: the run's compute dtype `model.dtype`."""

    @field_validator("prompt")
    @classmethod
    def _template(cls, path: str) -> str:
        import jinja2
        from jinja2 import meta

        file = Path(path)
        if not file.is_file():
            raise ValueError(f"the judge prompt file {path} does not exist (relative paths are read from the "
                             "directory `grpo train` runs in)")
        try:
            names = meta.find_undeclared_variables(jinja2.Environment().parse(file.read_text()))
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the judge prompt {path} is not a valid Jinja2 template: line {exc.lineno}: "
                             f"{exc.message}") from None
        if "completion" not in names:
            raise ValueError(f"the judge prompt {path} never uses {{{{ completion }}}}, so the judge would not see "
                             "what it scores; put {{ completion }} where the answer goes")
        return path

    @field_validator("parse")
    @classmethod
    def _parse(cls, parse: str) -> str:
        parse_kind(parse)
        return parse

    @model_validator(mode="after")
    def _fields_of_the_target(self) -> JudgeConfig:
        url = is_url(self.judge)
        wrong = [name for name, applies in (("api", url), ("model", url and self.api == "openai"),
                                            ("tokenizer", url and self.api == "grpo"), ("device", not url),
                                            ("dtype", not url))
                 if name in self.model_fields_set and not applies and getattr(self, name) !=
                 type(self).model_fields[name].default]
        if wrong:
            where = "a judge URL with api: openai" if url and self.api == "openai" else (
                "a judge URL with api: grpo" if url else "a local judge checkpoint")
            raise ValueError(f"{', '.join(wrong)} do(es) not apply to {where} ({self.judge}); drop it")
        return self


def judge_settings(kwargs: dict, where: str) -> dict:
    """`kwargs` validated as a `JudgeConfig`, every default written out; a ValueError naming each bad field as
    `where.field` otherwise."""
    try:
        return JudgeConfig.model_validate(kwargs).model_dump()
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "judge"
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{where}.{field}: {msg}" if err["type"] != "extra_forbidden" else
                         f"{where}.{field}: unknown judge setting (valid: {', '.join(JudgeConfig.model_fields)})")
        raise ValueError("; ".join(parts)) from None
