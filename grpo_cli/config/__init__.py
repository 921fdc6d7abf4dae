"""Pydantic configuration: the only home of defaults, preset loading, overrides, plans."""
