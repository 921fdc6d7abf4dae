"""Typer option types shared by the commands that load a config (train, plan, diagnose-mismatch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

PresetArg = Annotated[Optional[str], typer.Argument(help="Preset name (default tiny-cpu); see `grpo presets list`.")]
PresetOpt = Annotated[Optional[str], typer.Option("--preset", "-p", help="Preset name (same as the argument).")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML file merged over the preset.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override: --set train.learning_rate=1e-5")]
