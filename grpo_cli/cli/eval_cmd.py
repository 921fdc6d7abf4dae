"""`grpo eval RUN_DIR_OR_CHECKPOINT --data FILE`: held-out evaluation of any checkpoint, with a JSON report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from grpo_cli.cli.common import SetOpt, user_errors


def eval_command(
    target: Annotated[Path, typer.Argument(help="Run directory, checkpoint-N folder, LoRA adapter folder or Hugging "
                                                "Face model folder.")],
    data: Annotated[Optional[str], typer.Option(
        "--data", "-d", help="Evaluation prompts (.jsonl, .parquet, saved datasets folder, builtin:NAME:heldout); "
                             "default: the run's eval.source.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="JSON report path (default TARGET/eval.json).")] = None,
    overrides: SetOpt = None,
) -> None:
    """Run the run's own evaluation (eval.* settings, reward functions, engine, seed) once on a checkpoint and write
    a JSON report: eval/reward/mean, eval/reward/<fn>/mean, eval/pass@k, eval/completions/mean_length. At the same
    seed it gives the same numbers as the in-training evaluation of those weights."""
    with user_errors():
        from grpo_cli.eval.command import run_eval

        report = run_eval(target, data=data, out=out, overrides=list(overrides or []))
        typer.echo(json.dumps(report["metrics"], indent=2))
        typer.echo(f"wrote {report['written_to']}")
