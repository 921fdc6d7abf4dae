"""Generate the config reference of docs/configuration.md (markdown) from the schema, and docs/server-mode.md's table
of weight transports from `config/transports.py`: `python -m grpo_cli.config.reference` prints both, `--write` puts
each between its markers."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from grpo_cli.config.engine_modes import MODES
from grpo_cli.config.judge import JudgeConfig
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.config.transports import TRANSPORTS

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
TRANSPORTS_BEGIN, TRANSPORTS_END = "<!-- weight-transports:begin -->", "<!-- weight-transports:end -->"
DOCS = Path(__file__).resolve().parents[2] / "docs"


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


CLIENTS = {"serve-rollout": "`grpo serve-rollout`", "sglang": "SGLang", "vllm-serve": "stock `vllm serve`"}


def transport_table() -> str:
    """docs/server-mode.md's table: one row per transport of each client (`config.transports.TRANSPORTS`), the
    engines whose server rows take it (`config.engine_modes.MODES`), its topology, whether the config refuses a server
    on another host (`same_host`), and when to use it."""
    lines = [TRANSPORTS_BEGIN, "| transport | engines | topology | same host only | when to use it |",
             "|---|---|---|---|---|"]
    for t in TRANSPORTS:
        rows = [row for row in MODES.values() if row.client == t.client]
        engines = ", ".join(dict.fromkeys(row.engine for row in rows))  # an engine with several modes, once
        default = " (default)" if rows and rows[0].transports[0] == t.name else ""
        lines.append(f"| `{t.name}`{default} | {engines} ({CLIENTS.get(t.client, t.client)}) | {t.topology} | "
                     f"{'yes (loopback URLs)' if t.same_host else 'no'} | {t.when} |")
    return "\n".join([*lines, TRANSPORTS_END])


def write_between(page: Path, begin: str, end: str, text: str) -> None:
    """Replace the text between `begin` and `end` (markers included in `text`) in `page`."""
    old = page.read_text()
    page.write_text(old[: old.index(begin)] + text + old[old.index(end) + len(end):])


def write_reference(page: Path) -> None:
    """Replace the table between `BEGIN` and `END` in `page` with the current one."""
    write_between(page, BEGIN, END, reference_markdown())


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_reference(DOCS / "configuration.md")
        write_between(DOCS / "server-mode.md", TRANSPORTS_BEGIN, TRANSPORTS_END, transport_table())
    else:
        print(reference_markdown())
        print(transport_table())
