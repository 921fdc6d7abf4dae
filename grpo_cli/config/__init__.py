"""Pydantic configuration: the only home of defaults, preset loading, overrides, rules, plans, the DeepSpeed
JSON. The bottom layer: imports no other grpo_cli package and no torch at module level."""
