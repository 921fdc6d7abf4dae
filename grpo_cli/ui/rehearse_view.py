"""The table `grpo train --rehearse` ends with: each transition exercised on CPU (status, seconds, detail), then
what only a GPU can check."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

_STYLE = {"ok": "green", "FAIL": "bold red", "n/a": "dim", "GPU only": "yellow"}


def render_rehearsal(preset: str, checks, console: Console | None = None) -> None:
    """`checks`: objects with name, status, seconds (or None) and detail."""
    console = console or Console()
    table = Table(title=f"rehearsal of {preset} (CPU)", show_lines=False)
    for col, kw in (("transition", {}), ("status", {}), ("seconds", {"justify": "right"}), ("what was checked", {})):
        table.add_column(col, **kw)
    for c in checks:
        style = _STYLE.get(c.status, "")
        secs = ("" if c.seconds is None else "<0.001" if c.seconds < 1e-3 else f"{c.seconds:.3f}" if c.seconds < 1
                else f"{c.seconds:.1f}")
        table.add_row(c.name, f"[{style}]{c.status}[/]" if style else c.status, secs, c.detail)
    console.print(table)
