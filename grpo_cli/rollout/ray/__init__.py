"""Async mode's rollout actors: the Ray actor that holds an engine, the trainer-side engine that drives them, and
the batching of submissions across actors."""
