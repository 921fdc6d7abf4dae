"""Typer command-line layer: parse, load config, call one function; the heavy imports (torch, train, rollout) only
inside command bodies."""
