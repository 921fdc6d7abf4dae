"""Built-in reward functions. Signature of every reward: `f(prompts, completions, **columns) -> list[float | None]`."""

from __future__ import annotations

import re

from grpo_cli.rewards.model import reward_model, served_reward_model


def length(prompts, completions, *, target: int = 4, unit: str = "words", **_columns) -> list[float]:
    """−|target − len(completion)|, the length measured in `words` (whitespace split) or `chars`."""
    if unit not in ("words", "chars"):
        raise ValueError(f"length reward: unit must be 'words' or 'chars', got {unit!r}")
    size = (lambda c: len(c.split())) if unit == "words" else len
    return [-abs(target - size(c)) for c in completions]


def format_reward(prompts, completions, *, pattern: str, **_columns) -> list[float]:
    """1.0 when the whole completion matches the regex `pattern` (re.DOTALL), else 0.0."""
    rx = re.compile(pattern, re.DOTALL)
    return [1.0 if rx.fullmatch(c.strip()) else 0.0 for c in completions]


def exact_match(prompts, completions, *, answer: list | None = None, column: str = "answer",
                **columns) -> list[float | None]:
    """1.0 when the stripped completion equals the row's answer column, else 0.0 (None without an answer)."""
    answers = answer if answer is not None else columns.get(column)
    if answers is None:
        raise ValueError(f"exact_match needs a '{column}' column in the data (or set kwargs.column)")
    return [None if a is None else float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


_NUM = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _last_number(text: str) -> float | None:
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    found = _NUM.findall(boxed[-1] if boxed else text.replace(",", ""))
    if not found:
        return None
    value = found[-1]
    if "/" in value:
        num, den = value.split("/")
        return float(num) / float(den) if float(den) else None
    return float(value)


def math(prompts, completions, *, answer: list | None = None, column: str = "answer",
         **columns) -> list[float | None]:
    """1.0 when the last number in the completion (or its \\boxed{}) equals the answer's last number
    (GSM8K's "#### 42" works), else 0.0; None when the row has no numeric answer."""
    answers = answer if answer is not None else columns.get(column)
    if answers is None:
        raise ValueError(f"math needs a '{column}' column in the data (or set kwargs.column)")
    out: list[float | None] = []
    for c, a in zip(completions, answers):
        want = _last_number(str(a))
        got = _last_number(c)
        out.append(None if want is None else float(got is not None and abs(got - want) < 1e-6))
    return out


def overlong(prompts, completions, *, completion_ids: list[list[int]], max_completion_length: int, buffer: int,
             **_columns) -> list[float]:
    """DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13) on the completion's token count L, with
    L_max = rollout.max_completion_length: 0 if L ≤ L_max − buffer, (L_max − buffer − L) / buffer if
    L_max − buffer < L ≤ L_max (falling linearly to −1 at the cap), −1 beyond."""
    if not 0 < buffer <= max_completion_length:
        raise ValueError(f"overlong reward: kwargs.buffer={buffer} must lie in [1, rollout.max_completion_length="
                         f"{max_completion_length}]")
    free = max_completion_length - buffer
    return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / buffer) for ids in completion_ids]


_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def code_tests(prompts, completions, *, column: str = "tests", **columns) -> list[float]:
    """1.0 when the completion's last ```python block (the whole completion without one) runs and the row's tests
    column (Python statements, e.g. asserts) then passes in the same namespace; 0.0 when anything raises,
    `SystemExit` and `MemoryError` included. It runs generated code: the config requires `isolation: process`."""
    tests = columns.get(column)
    if tests is None:
        raise ValueError(f"code_tests needs a '{column}' column of tests in the data (or set kwargs.column)")
    out = []
    for completion, test in zip(completions, tests, strict=True):
        blocks = _CODE_BLOCK.findall(completion)
        code = blocks[-1] if blocks else completion
        try:
            exec(compile(f"{code}\n{test}", "<completion>", "exec"), {"__name__": "__completion__"})  # noqa: S102
            out.append(1.0)
        except BaseException:  # noqa: BLE001  (the code's failure, whatever it is)
            out.append(0.0)
    return out


BUILTIN_REWARDS = {
    "length": length, "format": format_reward, "exact_match": exact_match, "math": math, "overlong": overlong,
    "code_tests": code_tests, "reward_model": reward_model, "served_reward_model": served_reward_model,
}
