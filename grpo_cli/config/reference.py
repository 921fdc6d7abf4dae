"""Generate the config reference of docs/configuration.md (markdown) from the schema: `python -m
grpo_cli.config.reference` prints it, `--write` puts it between the markers of docs/configuration.md."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from grpo_cli.config.judge import JudgeConfig
from grpo_cli.config.schema import GRPOConfig

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _default(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump() for v in value]
    return f"`{value!r}`".replace("|", "\\|")


def _optional_section(ann) -> type[BaseModel] | None:
    """`Section | None` (a section that is off by default, e.g. `model.lora`) → the section's model."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def section_model(ann) -> type[BaseModel] | None:
    """The section model of a field's annotation (`Section` or `Section | None`); None for a single value."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    return _optional_section(ann)


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        doc = " ".join((field.description or "").split()).replace("|", "\\|")
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _rows(ann, f"{prefix}{name}.")
        elif (section := _optional_section(ann)) is not None:
            rows.append(f"| `{prefix}{name}` | {_default(field)} | {doc} |")
            rows += _rows(section, f"{prefix}{name}.")
        else:
            rows.append(f"| `{prefix}{name}` | {_default(field)} | {doc} |")
    return rows


ENTRY_SETTINGS = {"rewards.functions[judge].": JudgeConfig}
"""Settings of a kind of list entry (the keys of a `{judge: ...}` reward entry), listed after the fields."""


def reference_markdown() -> str:
    """One table of every leaf field: dotted key (as used by --set), default, documentation; then the settings of
    list entries (`ENTRY_SETTINGS`, written in the entry, not with --set)."""
    entries = [row for prefix, model in ENTRY_SETTINGS.items() for row in _rows(model, prefix)]
    lines = [BEGIN, "| key | default | meaning |", "|---|---|---|", *_rows(GRPOConfig, ""), *entries, END]
    return "\n".join(lines)


def write_reference(page: Path) -> None:
    """Replace the table between `BEGIN` and `END` in `page` with the current one."""
    text = page.read_text()
    page.write_text(text[: text.index(BEGIN)] + reference_markdown() + text[text.index(END) + len(END):])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_reference(Path(__file__).resolve().parents[2] / "docs" / "configuration.md")
    else:
        print(reference_markdown())
