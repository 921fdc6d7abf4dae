"""What every `grpo` command shares: option types, config loading, and the user-error → exit 2 handler."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from grpo_cli.config.errors import UserError

PresetArg = Annotated[Optional[str], typer.Argument(help="Preset name (default tiny-cpu); see `grpo presets list`.")]
PresetOpt = Annotated[Optional[str], typer.Option("--preset", "-p", help="Preset name (same as the argument).")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML file merged over the preset.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override: --set train.learning_rate=1e-5")]


@contextlib.contextmanager
def user_errors():
    """Print user errors as one paragraph on stderr and exit 2; programming errors keep their traceback."""
    try:
        yield
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def load_config(preset_arg, preset_opt, config, overrides):
    """Preset (positional or --preset, not two different ones) ← config file ← --set overrides."""
    from grpo_cli.config.load import ConfigError, build_config

    if preset_arg and preset_opt and preset_arg != preset_opt:
        raise ConfigError(f"two presets given ('{preset_arg}' and --preset '{preset_opt}'); give one.")
    return build_config(preset_opt or preset_arg, config, overrides or [])
