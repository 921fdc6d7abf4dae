"""Pydantic configuration: the only home of defaults, preset loading, overrides, the cross-field rules and the facts
they read (a model's shape, the engine modes, the weight transports); no torch at module level."""
