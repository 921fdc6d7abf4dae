"""Typer command-line layer: parse, load config, call one function. The top layer: may import any package,
the heavy ones (torch, train, rollout) only inside command bodies; nothing imports cli."""
