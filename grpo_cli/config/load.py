"""Build one `GRPOConfig` from schema defaults ← preset YAML ← user file ← `--set a.b=c`, with readable errors."""

from __future__ import annotations

import re
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpo_cli.config.errors import UserError
from grpo_cli.config.schema import GRPOConfig

DEFAULT_PRESET = "tiny-cpu"


class ConfigError(UserError):
    """A user error in the config: the CLI prints the message (one paragraph) and exits with code 2."""


def presets_dir() -> Path:
    """The shipped presets: `grpo_cli.presets` in a wheel, `presets/` in a source checkout."""
    try:
        found = Path(str(resources.files("grpo_cli.presets")))
        if any(found.glob("*.yaml")):
            return found
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / "presets"


def list_presets() -> dict[str, str]:
    """Preset name → its one-line description (the first comment line of the file)."""
    out = {}
    for path in sorted(presets_dir().glob("*.yaml")):
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        out[path.stem] = first.lstrip("# ").strip() if first.startswith("#") else ""
    return out


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; check the path.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {exc}. Fix the syntax and try again.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of config sections (model:, train:, ...).")
    return data


def load_preset(name: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The YAML mapping of a shipped preset, with `extends: OTHER` resolved (OTHER's values, then this one's)."""
    path = presets_dir() / f"{name}.yaml"
    if not path.exists():
        names = ", ".join(list_presets())
        raise ConfigError(f"unknown preset '{name}'. Available presets: {names}. See `grpo presets list`.")
    if name in _seen:
        raise ConfigError(f"preset '{name}' extends itself through {' -> '.join(_seen)}; break the cycle.")
    data = _read_yaml(path, f"preset '{name}'")
    parent = data.pop("extends", None)
    return deep_merge(load_preset(parent, (*_seen, name)), data) if parent else data


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_value(text: str) -> Any:
    """YAML scalar/list/mapping parsing, plus numbers YAML 1.1 reads as strings (`1e-3`)."""
    if _NUMBER.match(text.strip()):
        return float(text) if any(c in text for c in ".eE") else int(text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (["a", "b", "c"], parsed value)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(
            f"--set '{item}' is not of the form key.path=value (e.g. --set train.learning_rate=1e-5)."
        )
    return key.strip().split("."), parse_value(value)


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; lists and scalars in `update` replace those in `base`."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def set_path(tree: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    nested: Any = value
    for part in reversed(path):
        nested = {part: nested}
    return deep_merge(tree, nested)


def _model_at(loc: tuple, root: type[BaseModel] = GRPOConfig) -> type[BaseModel] | None:
    model: Any = root
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return model


def format_validation_error(exc: ValidationError) -> str:
    """One paragraph naming each bad field, what was given and how to fix it."""
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        field = ".".join(loc) or "config"
        if err["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            valid = ", ".join(parent.model_fields) if parent else "see `grpo presets show tiny-cpu`"
            where = ".".join(loc[:-1]) or "the top level"
            parts.append(f"{field}: unknown key. Valid keys under {where}: {valid}.")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        given = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        parts.append(f"{field}: {msg.rstrip('.')}{given}.")
    return "Invalid configuration: " + " ".join(parts) + " Fix it in your config file or with --set key=value."


def check_override_path(path: list[str], item: str) -> None:
    """Refuse `--set a.b.c=v` where `a.b` is a single value in the schema (a number, a name, a list): a sub-key
    there has no meaning, and merging it would replace the value by a mapping."""
    from grpo_cli.config.reference import section_model

    model: Any = GRPOConfig
    for depth, part in enumerate(path[:-1]):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return  # an unknown key: validation names it with the valid ones
        model = section_model(field.annotation)
        if model is None:
            choices = typing.get_args(field.annotation)
            if typing.get_origin(field.annotation) is dict or any(
                    isinstance(a, type) and issubclass(a, BaseModel) for a in choices):
                return  # a mapping or a choice of sections: validation judges the sub-key
            where = ".".join(path[: depth + 1])
            raise ConfigError(
                f"--set '{item}': {where} is a single value, not a section, so it has no sub-key "
                f"'{path[depth + 1]}'; set it as a whole (--set {where}=VALUE) or check the key's spelling "
                "(`grpo presets show NAME` lists every key)."
            )


def build_config(
    preset: str | None = None, file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> GRPOConfig:
    """Merge preset, user file and overrides (later wins) and validate into a frozen `GRPOConfig`.

    The base is `preset`, else the file's own `extends: NAME`, else the default preset; a file that names no
    preset starts from the default's model, data, rewards and sizes but not from its `eval` block (evaluation of
    the default's built-in task would not fit the file's own data)."""
    user = _read_yaml(Path(file), "config file") if file is not None else {}
    extends = user.pop("extends", None)
    if preset and extends and preset != extends:
        raise ConfigError(f"the preset '{preset}' and the config file's `extends: {extends}` disagree; keep one.")
    name = preset or extends or DEFAULT_PRESET
    base = load_preset(name)
    if file is not None and not (preset or extends):
        base.pop("eval", None)
    tree: dict[str, Any] = deep_merge(deep_merge(base, {"preset": name}), user)
    for item in overrides:
        path, value = parse_override(item)
        check_override_path(path, item)
        tree = set_path(tree, path, value)
    return validate_tree(tree)


def validate_tree(tree: dict[str, Any]) -> GRPOConfig:
    """Validate a plain mapping into `GRPOConfig`, turning pydantic errors into a `ConfigError`."""
    try:
        return GRPOConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def dump_config(cfg: GRPOConfig) -> str:
    """The resolved config as YAML (what is saved in every run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
