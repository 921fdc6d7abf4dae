"""Render a config as YAML with every field's documentation as a comment (for `grpo presets show`)."""

from __future__ import annotations

import textwrap

import yaml
from pydantic import BaseModel


def _scalar(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def documented_yaml(model: BaseModel, indent: int = 0) -> str:
    """YAML of `model` (nested sections indented) with `# doc` lines above each field."""
    lines: list[str] = []
    pad = " " * indent
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        for doc_line in textwrap.wrap(" ".join((field.description or "").split()), 100):
            lines.append(f"{pad}# {doc_line}")
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines.append(documented_yaml(value, indent + 2))
        else:
            dumped = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
            if isinstance(dumped, list) and dumped and isinstance(dumped[0], BaseModel):
                dumped = [v.model_dump(mode="json") for v in dumped]
            lines.append(f"{pad}{name}: {_scalar(dumped)}")
    return "\n".join(lines)
