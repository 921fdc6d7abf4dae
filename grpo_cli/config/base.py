"""Base class of every config section: strict, frozen, documented by attribute docstrings."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are errors; instances are immutable; field docs come from docstrings."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, validate_default=True)
