"""`GRPOConfig`, the run's whole configuration: the sections (`sections.py`) checked together by the cross-field
rules (`rules.py`), which read the sections alone, so no config module imports this one back."""

from __future__ import annotations

from pydantic import model_validator

from grpo_cli.config.rules import check_rules
from grpo_cli.config.sections import GRPOSections


class GRPOConfig(GRPOSections):
    """A validated config: every section, and every rule between them."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> GRPOConfig:
        check_rules(self)
        return self
