"""Resolve reward names to callables and score a batch, with errors that name the function and the sample."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math as _math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.config.errors import UserError
from grpo_cli.config.judge import JUDGE
from grpo_cli.config.reward_models import REWARD_MODEL
from grpo_cli.rewards.builtin import BUILTIN_REWARDS


class RewardError(UserError):
    """A reward function is missing, raised, or returned the wrong thing; the message says which and where."""


@dataclass(frozen=True)
class RewardFn:
    """A resolved reward function with its configured name, weight and keyword arguments."""

    name: str
    fn: Callable
    weight: float
    kwargs: dict
    label: str = ""
    """Name in metrics (`reward/<label>/mean`): the alias or the function's name, never a path (default: the
    function part of `name`)."""
    kind: str = "outcome"
    """`outcome` (one reward per completion) or `process` (one per step)."""
    isolation: dict | None = None
    """Process isolation settings (`workers`, `timeout_s`, `memory_mb`, `on_error`); None: called inline."""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", self.name.rpartition(":")[2])

    @property
    def metric(self) -> str:
        """This function's metric, `reward/<label>/mean`: training logs it, evaluation logs it under `eval/`
        (`eval/reward/<label>/mean`), so the two never differ and a function named `reward` cannot take the name
        of the weighted total (`eval/reward/mean`)."""
        return f"reward/{self.label}/mean"


def resolve(name: str) -> Callable:
    """`length` → built-in; `pkg.mod:fn` → imported; `path/to/file.py:fn` → loaded from the file."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    target, sep, attr = name.rpartition(":")
    if not sep or not target or not attr:
        raise RewardError(f"reward '{name}' is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor of the form "
                          "module:function or path/to/file.py:function.")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.exists():
                raise RewardError(f"reward '{name}': file {path} does not exist.")
            spec = importlib.util.spec_from_file_location(f"grpo_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except RewardError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code failing at import is a user error
        raise RewardError(f"reward '{name}': importing {target} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward '{name}': {target} has no function '{attr}'.")
    return fn


def metric_labels(functions) -> list[str]:
    """Metric name of each function: its `alias`, else the function name (`length`, `fn` of `dir/f.py:fn`).
    Names used by several functions become `NAME_1_of_2`, `NAME_2_of_2` (in config order), so the metric says
    plainly that two functions share the name."""
    base = [f.alias or f.name.rpartition(":")[2] for f in functions]
    seen: dict[str, int] = {}
    out = []
    for name in base:
        if base.count(name) == 1:
            out.append(name)
            continue
        seen[name] = seen.get(name, 0) + 1
        out.append(f"{name}_{seen[name]}_of_{base.count(name)}")
    return out


def build_reward_fns(functions, *, device=None, dtype: str | None = None, park: bool = False) -> list[RewardFn]:
    """Resolve every `rewards.functions` entry (fails before training starts). A local reward model
    (`reward_model`) is placed as the run says (`_placed_kwargs`); without `device`/`dtype` its own settings stay.
    A judge entry becomes its own `rewards.judge.Judge` (its settings are its state, not call kwargs)."""
    return [_judge_fn(f, label, device=device, dtype=dtype, park=park) if f.name == JUDGE else
            RewardFn(f.name, resolve(f.name), f.weight,
                     _placed_kwargs(dict(f.kwargs), device=device, dtype=dtype, park=park)
                     if f.name == REWARD_MODEL else dict(f.kwargs), label, f.kind,
                     {"workers": f.workers, "timeout_s": f.timeout_s, "memory_mb": f.memory_mb,
                      "on_error": f.on_error} if getattr(f, "isolation", "inline") == "process" else None)
            for f, label in zip(functions, metric_labels(functions), strict=True)]


def _judge_fn(f, label: str, *, device, dtype: str | None, park: bool) -> RewardFn:
    """A judge entry's `Judge`, its parser a regex or a function imported like a reward function (a wrong name
    stops the run before training, naming `parse`); a local judge is placed as a reward model is
    (`_placed_kwargs`: `device: auto` the trainer's device, the compute dtype unless it names one, `park`)."""
    from grpo_cli.config.judge import JudgeConfig, is_url, parse_kind
    from grpo_cli.rewards.judge import Judge
    from grpo_cli.rewards.judge_parse import regex_parser

    cfg, parks = JudgeConfig.model_validate(f.kwargs), False
    if not is_url(cfg.judge):
        where = _placed_kwargs({"device": cfg.device, **({"dtype": cfg.dtype} if cfg.dtype else {})},
                               device=device, dtype=dtype, park=park)
        parks = where.pop("park")
        cfg = cfg.model_copy(update=where)
    try:
        parser = regex_parser(cfg.parse) if parse_kind(cfg.parse) == "regex" else resolve(cfg.parse)
    except RewardError as exc:
        raise RewardError(f"rewards.functions[{label}].parse: {exc}") from None
    return RewardFn(f.name, Judge(cfg, parser, label, park=parks), f.weight, {}, label, f.kind)


def pop_reward_metrics(fns: list[RewardFn]) -> dict[str, float]:
    """The reward functions' own metrics since the last call (a judge's `judge/<name>/...` counts), which also
    ends their step (a judge's answer cache is emptied): called once per training step and once per evaluation."""
    from grpo_cli.rewards.judge import Judge

    out: dict[str, float] = {}
    for rf in fns:
        if isinstance(rf.fn, Judge):
            out.update(rf.fn.pop_metrics())
    return out


def _placed_kwargs(kwargs: dict, *, device, dtype: str | None, park: bool) -> dict:
    """A reward model's kwargs in a run: `device: auto` becomes the trainer's resolved `device` (as a name, which a
    process worker can take too), the model loads in `dtype` (the compute dtype) unless it names its own, and
    `park` keeps it in host memory between scorings (`config.reward_models.parks_reward_models`)."""
    if device is not None and kwargs.get("device", "cpu") == "auto":
        kwargs["device"] = str(device)
    if dtype is not None:
        kwargs.setdefault("dtype", dtype)
    kwargs.setdefault("park", park)
    return kwargs


def reward_fns_for(cfg, device) -> list[RewardFn]:
    """The run's reward functions, a local reward model on the training `device` the trainer resolved (for
    `device: auto`), in the compute dtype `model.dtype`, parked in host memory while a colocated engine generates."""
    from grpo_cli.config.reward_models import parks_reward_models

    return build_reward_fns(cfg.rewards.functions, device=device, dtype=cfg.model.dtype,
                            park=parks_reward_models(cfg))


def _check_output(rf: RewardFn, values, n: int, completions: list[str]) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
        raise RewardError(f"reward '{rf.name}' returned {got} for {n} completions; it must return one float "
                          f"(or None) per completion. First completion: {completions[0]!r}")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(_math.nan)
        elif isinstance(v, (int, float)) and _math.isfinite(v):
            out.append(float(v))
        else:
            raise RewardError(f"reward '{rf.name}' returned {v!r} for sample {i} ({completions[i]!r}); "
                              "rewards must be finite numbers or None.")
    return out


def _named_extras(rf: RewardFn, extras: dict) -> dict:
    """The rollout facts (`extras`) whose names `rf`'s function declares as parameters, unless kwargs set them."""
    try:
        params = inspect.signature(rf.fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return {}
    return {k: v for k, v in extras.items() if k in params and k not in rf.kwargs}


def score(fns: list[RewardFn], prompts: list[str], completions: list[str], columns: dict[str, list],
          *, on_error: str, extras: dict | None = None) -> tuple[list[list[float]], int]:
    """Rewards (B, F) as nested lists with NaN for None, and the number of function calls that raised and were
    skipped (`on_error: skip`). `extras` (e.g. `completion_ids`, `max_completion_length`) go only to functions
    that name them as parameters, so `f(prompts, completions, **columns)` functions see the data columns only."""
    table, errors = [], 0
    for rf in fns:
        if rf.isolation is not None:
            from grpo_cli.rewards.isolated import score_isolated

            table.append(score_isolated(rf, prompts, completions, columns, _named_extras(rf, extras or {})))
            continue
        try:
            values = rf.fn(prompts, completions, **columns, **rf.kwargs, **_named_extras(rf, extras or {}))
        except Exception as exc:  # noqa: BLE001 - user code: report which function and sample
            if on_error == "skip":
                errors += 1
                table.append([_math.nan] * len(completions))
                continue
            raise RewardError(f"reward '{rf.name}' raised {type(exc).__name__}: {exc} while scoring a batch of "
                              f"{len(completions)} completions (first prompt: {prompts[0]!r}, first completion: "
                              f"{completions[0]!r}). Fix the function or set rewards.on_error=skip.") from exc
        table.append(_check_output(rf, values, len(completions), completions))
    return [list(row) for row in zip(*table)], errors
