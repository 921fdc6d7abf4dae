"""The `rewards:` section: reward functions (built-ins, user functions, reward models, generative judges) and how
their scores combine."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from grpo_cli.config.base import Section
from grpo_cli.config.judge import JUDGE, JudgeConfig, judge_settings


class RewardFunctionConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _model_shorthand(cls, data: Any) -> Any:
        """`{model: PATH, batch_size: N, device: D}` is `{name: reward_model, kwargs: {model: PATH, ...}}`;
        `{url: URL, ...}` is `{name: served_reward_model, kwargs: {url: URL, ...}}` (also `tokenizer`, `retries`);
        `{judge: URL_OR_PATH, prompt: FILE, ...}` is `{name: judge, kwargs: {...}}` with every `JudgeConfig` key,
        whose settings are then checked and written out in full (`config.judge.judge_settings`)."""
        for key, name, extra in (("judge", JUDGE, tuple(k for k in JudgeConfig.model_fields if k != "judge")),
                                 ("model", "reward_model", ("batch_size", "device")),
                                 ("url", "served_reward_model", ("batch_size", "tokenizer", "retries"))):
            if isinstance(data, dict) and key in data and "name" not in data:
                data = dict(data)
                moved = {k: data.pop(k) for k in (key, *extra) if k in data}
                data = {**data, "name": name, "kwargs": {**moved, **data.get("kwargs", {})}}
        if isinstance(data, dict) and data.get("name") == JUDGE and isinstance(data.get("kwargs", {}), dict):
            data = {**data, "kwargs": judge_settings(data.get("kwargs", {}),
                                                     f"rewards.functions[{data.get('alias') or JUDGE}]")}
        return data

    name: str
    """A built-in (`length`, `format`, `exact_match`, `math`, `overlong`, `code_tests`, `reward_model`, `judge`) or a user
    function `module:function` / `path/to/file.py:function` with signature `f(prompts, completions, **columns) ->
    list[float | None]`. A function that names `completion_ids`, `max_completion_length`, `messages` (tool-calling
    trajectories) or `prompt_messages` (the chat messages of each prompt) as parameters also receives them.
    `overlong` is DAPO's soft length penalty: 0 up to max_completion_length - buffer tokens, then falling linearly
    to -1 at the cap (kwargs: `buffer`, required). `{model: PATH}` (optionally `batch_size`) is short for
    `{name: reward_model, kwargs: {model: PATH}}`: a sequence-classification checkpoint's score; `{url: URL}`
    (optionally `tokenizer`, `batch_size`, `retries`) for `served_reward_model`, a served one (`/classify`).
    `{judge: URL_OR_PATH, prompt: FILE}` (optionally `parse`, `api`, `model`, `tokenizer`, `max_tokens`,
    `temperature`, `batch_size`, `retries`, `timeout_s`, `token_env`, `device`) is a generative judge: the judge
    model answers the rendered prompt and `parse` turns its answer into the score (docs/rewards-and-data.md,
    "Generative judges")."""
    alias: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]+$")
    """Name of this function in metrics (`reward/<alias>/mean`); default: the function's name (`length`,
    `my_fn` for `path/to/file.py:my_fn`), never a path. Letters, digits, `_`, `-`, `.`."""
    weight: float = 1.0
    """Weight of this function in the summed reward."""
    kind: Literal["outcome", "process"] = "outcome"
    """`outcome`: one reward per completion. `process`: one reward per step, the function also getting `steps`
    (each completion split on `rewards.step_separator`) and returning one list per completion, a float (or None)
    per step. With any process function, every step reward of a group is normalised together (an outcome reward
    counts as a step ending at the last token) and a token's advantage is the sum over the steps ending at or
    after it."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the function (e.g. `target` for `length`, `pattern` for `format`)."""
    isolation: Literal["inline", "process"] = "inline"
    """`process`: each completion is scored by its own call in a pool of separate worker interpreters, each in its
    own process group, with a fresh temporary working directory per call and a scrubbed environment; a call past
    `timeout_s`, a crash, `sys.exit`, an exception or a limit hit scores `on_error` and the worker is replaced, so
    the run goes on. Not a security boundary (same user, same machine): run untrusted code in containers."""
    workers: int = Field(4, ge=1)
    """Process isolation: worker interpreters scoring in parallel."""
    timeout_s: float = Field(30.0, gt=0)
    """Process isolation: seconds one completion's call may take before its process group is killed."""
    memory_mb: int | None = Field(None, ge=64)
    """Process isolation: address-space cap of each worker (RLIMIT_AS); null: none."""
    on_error: float | None = None
    """Process isolation: the score of a completion whose call failed, timed out or died (null: missing, left out
    of the means)."""

    @model_validator(mode="after")
    def _isolation_fields(self) -> RewardFunctionConfig:
        process_only = {name for name in ("workers", "timeout_s", "memory_mb", "on_error")
                        if getattr(self, name) != type(self).model_fields[name].default}  # a full dump validates
        if self.isolation == "inline" and process_only:
            raise ValueError(f"rewards.functions[{self.name}]: {', '.join(sorted(process_only))} apply to "
                             "isolation: process only; set isolation: process or drop them.")
        if self.name == JUDGE and self.isolation == "process":
            raise ValueError(f"rewards.functions[{self.alias or JUDGE}]: a judge runs inline (its requests run "
                             "`batch_size` at a time, each with its own timeout_s and retries); drop isolation: "
                             "process.")
        if self.name == "code_tests" and self.isolation != "process":
            raise ValueError("rewards.functions[code_tests] runs generated code: it needs isolation: process "
                             "(with timeout_s, and memory_mb to cap memory).")
        return self


class RewardsConfig(Section):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig(name="length", kwargs={"target": 4})]
    )
    """Reward functions; their weighted sum is the reward that advantages normalise."""
    step_separator: str = Field("\n", min_length=1)
    """Separator that splits a completion into the steps `process` reward functions score (blank steps are
    dropped; a step ends with its separator)."""
    on_error: Literal["raise", "skip"] = "raise"
    """A reward function that raises: `raise` stops with the function and sample named; `skip` scores that
    batch of the function as missing (None) and counts it in `rewards/errors`."""

    @model_validator(mode="after")
    def _unique_aliases(self) -> RewardsConfig:
        aliases = [f.alias for f in self.functions if f.alias]
        twice = sorted({a for a in aliases if aliases.count(a) > 1})
        if twice:
            raise ValueError(f"rewards.functions: alias {', '.join(map(repr, twice))} is given to more than one "
                             "function; metric names must differ, so give each function its own alias.")
        return self
