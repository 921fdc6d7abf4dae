"""Every config field is documented (the docs are what `presets show` prints); the schema is strict."""

from __future__ import annotations

from pydantic import BaseModel

from grpo_cli.config.docs import documented_yaml
from grpo_cli.config.load import build_config
from grpo_cli.config.schema import GRPOConfig


def _models(model: type[BaseModel], seen=None):
    seen = seen if seen is not None else set()
    if model in seen:
        return seen
    seen.add(model)
    for field in model.model_fields.values():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            _models(ann, seen)
    return seen


def test_every_field_has_a_docstring():
    missing = [f"{m.__name__}.{n}" for m in _models(GRPOConfig) for n, f in m.model_fields.items()
               if not (f.description or "").strip()]
    assert missing == []


def test_every_section_forbids_extra_and_is_frozen():
    for m in _models(GRPOConfig):
        assert m.model_config.get("extra") == "forbid", m.__name__
        assert m.model_config.get("frozen") is True, m.__name__


def test_documented_yaml_shows_values_and_docs():
    text = documented_yaml(build_config("tiny-cpu"))
    assert "learning_rate: 0.003" in text
    assert "# Peak AdamW learning rate." in text
    assert "  engine: hf" in text
