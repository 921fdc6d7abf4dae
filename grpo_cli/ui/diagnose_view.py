"""Terminal rendering of a `grpo diagnose-mismatch` report: metric table with verdicts, log-ratio histogram,
worst sequences and tokens, what each correction option would do, and the recommendation."""

from __future__ import annotations

import math
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table

VERDICT_STYLE = {
    "ok": "[green]OK[/]", "watch": "[yellow]watch[/]", "correct": "[bold red]correct it[/]", "info": "[dim]-[/]",
}
BAR_WIDTH = 40
TEXT_WIDTH = 48


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if x == 0 or 1e-3 <= abs(x) < 1e5 else f"{x:.3e}"


def _clip(text: str, width: int = TEXT_WIDTH, *, keep_end: bool = False) -> str:
    """One line of at most `width` characters: the start of `text` (or its end, for contexts before a token)."""
    text = " ".join(text.split())
    if len(text) > width:
        text = "…" + text[-(width - 1):] if keep_end else text[: width - 1] + "…"
    return escape(text)


def _edge(x: float | None, *, low: bool) -> str:
    if x is None:
        return "-inf" if low else "+inf"
    return f"{'-' if x < 0 else '+'}1e{round(math.log10(abs(x)))}"


def histogram_lines(bins: list[dict], width: int = BAR_WIDTH) -> list[str]:
    """One text line per bin from the first to the last non-empty one (the |x| < 1e-6 bin always shown)."""
    center = len(bins) // 2
    used = [i for i, b in enumerate(bins) if b["count"]] or [center]
    lo, hi = min(used[0], center), max(used[-1], center)
    peak = max(b["count"] for b in bins) or 1
    lines = []
    for b in bins[lo : hi + 1]:
        n = b["count"]
        bar = "█" * round(width * n / peak) or ("▏" if n else "")
        label = f"[{_edge(b['lo'], low=True)}, {_edge(b['hi'], low=False)})"
        lines.append(f"{label:>16} {bar:<{width}} {n}")
    return lines


def metric_table(report: dict) -> Table:
    table = Table(title="rollout_correction/ metrics (train = trainer recompute, rollout = engine)",
                  title_justify="left")
    for col, justify in [("metric", "left"), ("value", "right"), ("verdict", "left"), ("thresholds", "left"),
                         ("meaning", "left")]:
        table.add_column(col, justify=justify, overflow="fold")
    for row in report["metrics"]:
        table.add_row(row["name"], _num(row["value"]), VERDICT_STYLE[row["verdict"]], row["rule"], row["meaning"])
    return table


def worst_tables(report: dict) -> tuple[Table, Table]:
    seqs = Table(title="worst sequences (by |mean_t rollout − mean_t train|)", title_justify="left")
    for col in ("seq", "prompt ⟶ completion", "len", "train mean", "rollout mean", "log ppl diff"):
        seqs.add_column(col, overflow="fold")
    for s in report["worst_sequences"]:
        text = f"{_clip(s['prompt'], 20, keep_end=True)} ⟶ {_clip(s['completion'])}"
        seqs.add_row(str(s["sequence"]), text, str(s["length"]), f"{s['train_mean_logprob']:.5f}",
                     f"{s['rollout_mean_logprob']:.5f}", _num(s["log_ppl_diff"]))
    toks = Table(title="worst tokens (by |log ρ|, log ρ = train − rollout)", title_justify="left")
    for col in ("seq", "pos", "token", "context", "train logp", "rollout logp", "log ρ"):
        toks.add_column(col, overflow="fold")
    for t in report["worst_tokens"]:
        toks.add_row(str(t["sequence"]), str(t["position"]), _clip(repr(t["token"]), 16),
                     _clip(t["context"], 32, keep_end=True), f"{t['train_logprob']:.5f}",
                     f"{t['rollout_logprob']:.5f}", _num(t["log_ratio"]))
    return seqs, toks


def options_table(report: dict) -> Table:
    """One row per level × action; each cell is C → affected fraction (tokens for token level, else sequences)."""
    rec = report["recommendation"]
    table = Table(title="what each is_correction option would truncate/mask on this sample "
                        "(* configured, ◀ recommended)", title_justify="left")
    for col in ("level", "action", "affects", "threshold C → fraction affected"):
        table.add_column(col, overflow="fold")
    groups: dict[tuple[str, str], list[str]] = {}
    for o in report["options"]:
        unit = "tokens_affected" if o["level"] == "token" else "sequences_affected"
        mark = "*" if o["configured"] else ""
        if (o["level"], o["action"], o["threshold"], o["lower"]) == (rec["level"], rec["action"], rec["threshold"],
                                                                      rec["lower"]):
            mark += "◀"
        bound = f"{o['threshold']:g}" + (f"/lower {o['lower']:g}" if o["lower"] is not None else "")
        groups.setdefault((o["level"], o["action"]), []).append(f"{bound}→{o[unit]:.1%}{mark}")
    for (level, action), cells in groups.items():
        table.add_row(level, action, "tokens" if level == "token" else "sequences", "  ".join(cells))
    return table


def recommendation_lines(report: dict) -> list[str]:
    rec = report["recommendation"]
    state = "enabled" if rec["enabled"] else "disabled"
    lower = "" if rec["lower"] is None else f" lower={rec['lower']:g}"
    lines = [
        f"[bold]overall:[/] {VERDICT_STYLE[rec['verdict']]} — {escape(rec['reason'])}",
        f"[bold]use:[/] is_correction {state}, level={rec['level']} action={rec['action']} "
        f"threshold={rec['threshold']:g}{lower} → affects {rec['tokens_affected']:.2%} of tokens, "
        f"{rec['sequences_affected']:.1%} of sequences on this sample",
    ]
    if rec["overrides"]:
        lines.append("  " + " ".join(f"--set {escape(o)}" for o in rec["overrides"]))
    lines += [f"[dim]note:[/] {escape(n)}" for n in rec["notes"]]
    for g in report["gates"]:
        sign = ">" if g["op"] == "above" else "<"
        status = "[bold red]FAILED[/]" if g["failed"] else "[green]passed[/]"
        lines.append(f"gate {g['metric']} {sign} {g['limit']:g}: value {_num(g['value'])} → {status}")
    return lines


def render_report(report: dict, *, stream: TextIO | None = None, console: Console | None = None) -> None:
    """Print the whole report (120 columns when the stream is not a terminal)."""
    if console is None:
        probe = Console(file=stream)
        console = probe if probe.is_terminal else Console(file=stream, width=120)
    s, lr = report["setup"], report["log_ratio"]
    console.print(
        f"[bold]Training–inference mismatch[/]: {s['engine']} ({s['mode']}) rollouts in {s['rollout_dtype']} vs "
        f"trainer {s['training_dtype']}/{s['attn_implementation']}\n{escape(s['model'])} · {s['num_sequences']} "
        f"sequences ({s['num_prompts']} prompts × {s['generations_per_prompt']}) · {s['num_tokens']} tokens · "
        f"temperature {s['temperature']:g} top_p {s['top_p']:g} top_k {s['top_k']} · {s['seconds']:.1f} s"
    )
    console.print(metric_table(report))
    console.print(f"[bold]per-token log ρ[/] (mean {_num(lr['mean'])}, std {_num(lr['std'])}; |log ρ| p50 "
                  f"{_num(lr['abs_p50'])}, p90 {_num(lr['abs_p90'])}, p99 {_num(lr['abs_p99'])}, max "
                  f"{_num(lr['abs_max'])})")
    for line in histogram_lines(lr["histogram"]):
        console.print(escape(line), highlight=False)
    for table in (*worst_tables(report), options_table(report)):
        console.print(table)
    for line in recommendation_lines(report):
        console.print(line, highlight=False)
