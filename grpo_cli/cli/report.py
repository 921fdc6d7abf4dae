"""`grpo report RUN_DIR`: a summary table and PNG plots of a finished or still-running run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from grpo_cli.cli.common import user_errors


def report(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (the --output-dir of `grpo train`).")],
    out_dir: Annotated[Optional[Path], typer.Option(
        "--out-dir", "-o", help="Where the PNGs go (default RUN_DIR/report).")] = None,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Print the table only (no matplotlib needed).")] = False,
    smooth: Annotated[int, typer.Option(
        min=0, help="Moving-average window in steps; 0 = auto (off below 100 steps), 1 = raw values.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary (and plot paths) as JSON.")] = False,
) -> None:
    """Summarise a run: first/last-10% means, min, max and last value of reward, loss, KL, mismatch, throughput
    and memory; time per phase; PNG plots of reward (mean ± std), KL, loss, mismatch metrics and the per-step
    phase-time stack. Works while the run is still writing; plots whose metrics were not logged are skipped."""
    with user_errors():
        _report(run_dir, out_dir, no_plots=no_plots, smooth=smooth, as_json=as_json)


def _report(run_dir: Path, out_dir: Path | None, *, no_plots: bool, smooth: int, as_json: bool) -> None:
    from grpo_cli.ui.report import Console, jsonable, load_run, render_summary, summarize, write_plots

    run = load_run(run_dir)
    info = summarize(run)
    written, skipped = [], {}
    if run.rows and not no_plots:
        written, skipped = write_plots(run, out_dir or run_dir / "report", window=smooth or None)
    if as_json:
        payload = {**info, "plots": [str(p) for p in written], "skipped_plots": skipped}
        typer.echo(json.dumps(jsonable(payload), indent=2, allow_nan=False))
        return
    if not run.rows:
        typer.echo(f"{run_dir}: no steps logged yet ({info['status']}).")
        return
    render_summary(info, Console())
    for path in written:
        typer.echo(f"wrote {path}")
    for name, why in skipped.items():
        typer.echo(f"skipped {name}: {why}")
