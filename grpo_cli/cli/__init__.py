"""Typer command-line layer: parse, load config, call one function. Imports no torch at module level."""
