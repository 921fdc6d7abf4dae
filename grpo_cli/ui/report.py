"""`grpo report`: read a run directory (finished, or still being written) into a summary table (rich) and PNG
plots drawn with matplotlib's Agg canvas: reward ± std, KL, loss, mismatch metrics and the phase-time stack."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from grpo_cli.config.errors import UserError

SUMMARY_METRICS = (  # (key, label, format); rows appear only for metrics the run logged
    ("reward/mean", "reward mean", ".3f"), ("reward/std", "reward std", ".3f"),
    ("reward/frac_zero_std_groups", "zero-std groups", ".2f"), ("loss", "loss", ".4f"),
    ("kl", "kl (ref)", ".4f"), ("entropy", "entropy", ".3f"), ("grad_norm", "grad norm", ".3f"),
    ("completions/mean_length", "completion length", ".1f"), ("completions/clipped_ratio", "clipped ratio", ".2f"),
    ("rollout_correction/k3_kl", "mismatch k3_kl", ".2e"), ("rollout_correction/is_weight_mean", "IS weight mean", ".3f"),
    ("rollout_correction/ess", "IS ess", ".3f"), ("tokens_per_second", "tokens/s", ".0f"),
    ("time/step", "step time (s)", ".2f"), ("memory/peak_rss_mb", "peak RSS (MB)", ".0f"),
    ("memory/cuda_peak_allocated_mb", "GPU cuda_peak_allocated (MB)", ".0f"),
    ("memory/cuda_peak_reserved_mb", "GPU cuda_peak_reserved (MB)", ".0f"),
    ("memory/cuda_peak_device_mb", "GPU cuda_peak_device (MB)", ".0f"),
    ("eval/reward/mean", "eval reward (held-out)", ".3f"), ("eval/pass@1", "eval pass@1", ".3f"),
)
MISMATCH_METRICS = ("k3_kl", "kl", "chi2_token", "is_weight_mean", "ess", "log_ppl_abs_diff")
NOT_PHASES = ("time/step",)  # totals, not phases
PHASE_PEAK = "memory/cuda_peak_allocated_mb"  # + "/<phase>": a phase's CUDA allocator peak


@dataclass
class Run:
    """The steps of one run: one row per step (the last write wins, so a resumed run's repeated steps count once)."""

    path: Path
    rows: list[dict]
    summary: dict | None = None
    config: dict = field(default_factory=dict)
    bad_lines: int = 0

    @property
    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.rows]

    def values(self, key: str) -> list[float]:
        """Per-step values of `key`, NaN where the step did not log it or logged null."""
        out = []
        for r in self.rows:
            v = r.get(key)
            out.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan)
        return out

    def has(self, key: str) -> bool:
        return any(math.isfinite(v) for v in self.values(key))

    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.rows:
            seen.update(dict.fromkeys(r))
        return list(seen)

    def phases(self) -> list[str]:
        return [k for k in self.keys() if k.startswith("time/") and k not in NOT_PHASES and self.has(k)]

    def reward_functions(self) -> list[str]:
        """Per-function reward means (`reward/<name>/mean`)."""
        return [k for k in self.keys() if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2]

    @property
    def total_steps(self) -> int | None:
        steps = self.config.get("train", {}).get("steps") if isinstance(self.config, dict) else None
        return int(steps) if isinstance(steps, int) else None

    @property
    def status(self) -> str:
        if self.summary is not None:
            return "interrupted" if self.summary.get("interrupted") else "finished"
        age = time.time() - (self.path / "metrics.jsonl").stat().st_mtime
        return f"running or stopped (last write {age:.0f} s ago)"


def load_run(path: Path) -> Run:
    """Read `metrics.jsonl` (tolerating a half-written last line), `summary.json` and `config.yaml`."""
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise UserError(f"{path}: no such run directory (give the --output-dir of a `grpo train` run).")
    if not metrics.is_file():
        raise UserError(f"{path} has no metrics.jsonl, so it is not a run directory (or the run has not started).")
    by_step: dict[int, dict] = {}
    bad = 0
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
            by_step[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            bad += line.strip() != ""
    summary = None
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text())
        except ValueError:
            summary = None
    return Run(path, [by_step[s] for s in sorted(by_step)], summary, _read_config(path / "config.yaml"), bad)


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


# ---- numbers ----------------------------------------------------------------------------------------------------

def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _mean(values: list[float]) -> float:
    vals = _finite(values)
    return sum(vals) / len(vals) if vals else math.nan


def describe(values: list[float]) -> dict[str, float]:
    """first/last 10% means (at least one step each), min, max and the last logged value."""
    tenth = max(1, len(values) // 10)
    vals = _finite(values)
    return {"first_10pct": _mean(values[:tenth]), "last_10pct": _mean(values[-tenth:]),
            "min": min(vals) if vals else math.nan, "max": max(vals) if vals else math.nan,
            "last": vals[-1] if vals else math.nan}


def summarize(run: Run) -> dict:
    """Everything the table shows, as plain data (also what `grpo report --json` prints)."""
    fns = run.reward_functions()
    keys = [k for k, _, _ in SUMMARY_METRICS] + (fns if len(fns) > 1 else [])  # one function = reward/mean
    metrics = {k: describe(run.values(k)) for k in dict.fromkeys(keys) if run.has(k)}
    totals = {p: sum(_finite(run.values(p))) for p in run.phases()}
    whole = sum(totals.values())
    phases = {p.removeprefix("time/"): {"total_s": t, "share": t / whole if whole else math.nan,
                                        "mean_s": _mean(run.values(p))} for p, t in totals.items()}
    for name, p in phases.items():  # CUDA runs: each phase's largest allocator peak over the steps
        peaks = _finite(run.values(f"{PHASE_PEAK}/{name}"))
        if peaks:
            p["peak_allocated_mb"] = max(peaks)
    times = _finite(run.values("time"))
    return {"run_dir": str(run.path), "preset": run.config.get("preset"), "status": run.status,
            "steps_logged": len(run.rows), "last_step": run.steps[-1] if run.rows else None,
            "total_steps": run.total_steps, "wall_s": times[-1] - times[0] if len(times) > 1 else None,
            "unreadable_lines": run.bad_lines, "metrics": metrics, "phases": phases}


def jsonable(obj):
    """`obj` with NaN/inf replaced by None, so `json.dumps` writes valid JSON."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [jsonable(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def render_summary(info: dict, console: Console) -> None:
    """The summary as rich tables (plain text off a terminal)."""
    steps = f"step {info['last_step']}" + (f"/{info['total_steps']}" if info["total_steps"] else "")
    wall = f" · {info['wall_s']:.0f} s wall" if info["wall_s"] else ""
    console.print(f"[bold]{info['run_dir']}[/bold] · preset {info['preset'] or '-'} · {steps} · "
                  f"{info['status']}{wall}", highlight=False)
    if info["unreadable_lines"]:
        console.print(f"note: {info['unreadable_lines']} unreadable line(s) in metrics.jsonl skipped", highlight=False)
    labels = {k: (label, spec) for k, label, spec in SUMMARY_METRICS}
    table = Table(title="metrics", title_justify="left")
    for col in ("metric", "first 10%", "last 10%", "min", "max", "last"):
        table.add_column(col, justify="left" if col == "metric" else "right", style="cyan" if col == "metric" else None,
                         no_wrap=col == "metric")
    for key, d in info["metrics"].items():
        label, spec = labels.get(key, (key, ".3f"))
        table.add_row(label, *(_fmt(d[c], spec) for c in ("first_10pct", "last_10pct", "min", "max", "last")))
    console.print(table)
    if info["phases"]:
        phases = Table(title="time per phase", title_justify="left")
        peaks = any("peak_allocated_mb" in p for p in info["phases"].values())
        for col in ("phase", "total s", "share", "mean s/step") + (("GPU peak MB",) if peaks else ()):
            phases.add_column(col, justify="left" if col == "phase" else "right", style="cyan" if col == "phase" else None)
        for name, p in sorted(info["phases"].items(), key=lambda kv: -kv[1]["total_s"]):
            phases.add_row(name, _fmt(p["total_s"], ".1f"), _fmt(100 * p["share"], ".1f") + "%", _fmt(p["mean_s"], ".3f"),
                           *((_fmt(p.get("peak_allocated_mb"), ".0f"),) if peaks else ()))
        console.print(phases)


# ---- plots ------------------------------------------------------------------------------------------------------

def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over the finite values of the last `window` steps (NaN where none)."""
    out = []
    for i in range(len(values)):
        out.append(_mean(values[max(0, i - window + 1) : i + 1]))
    return out


def auto_window(n_steps: int) -> int:
    """Smoothing window when none is given: off below 100 steps, then ~4% of the run."""
    return 1 if n_steps < 100 else max(2, n_steps // 25)


def _figure(nrows: int = 1, ncols: int = 1, *, width: float = 8.0, height: float = 4.2):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise UserError(f"plots need matplotlib ({exc}); install it with `pip install 'grpo-cli[report]'`, or pass "
                        "--no-plots for the table only.") from None
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas: renders PNGs without a display or pyplot's global state
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    return fig, axes


def _line(ax, steps, values, window: int, label: str | None = None, color=None) -> None:
    if window > 1:
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _smooth(values, window), color=color, linewidth=1.6, label=label)
    else:
        ax.plot(steps, values, color=color, linewidth=1.4, marker="." if len(steps) <= 60 else None, label=label)


def _plot_reward(run: Run, window: int):
    fig, axes = _figure()
    ax, steps = axes[0, 0], run.steps
    mean, std = run.values("reward/mean"), run.values("reward/std")
    if window > 1:
        mean_s, std = _smooth(mean, window), _smooth(std, window)
    else:
        mean_s = mean
    if run.has("reward/std"):
        ax.fill_between(steps, [m - s for m, s in zip(mean_s, std)], [m + s for m, s in zip(mean_s, std)],
                        color="C0", alpha=0.18, linewidth=0, label="± std (within step)")
    _line(ax, steps, mean, window, "reward mean", "C0")
    fns = run.reward_functions()
    for i, key in enumerate(fns if len(fns) > 1 else []):
        _line(ax, steps, run.values(key), window, key.split("/")[1], f"C{i + 1}")
    if run.has("eval/reward/mean"):  # logged every eval.every_steps: points joined, never smoothed
        points = [(s, v) for s, v in zip(steps, run.values("eval/reward/mean")) if math.isfinite(v)]
        ax.plot(*zip(*points), color="C3", marker="o", linewidth=1.4, label="eval reward (held-out)")
    ax.set(title="reward", xlabel="step", ylabel="reward")
    ax.legend(loc="best", fontsize="small")
    return fig


def _plot_single(run: Run, window: int, key: str, title: str, extra: str | None = None):
    fig, axes = _figure(1, 2 if extra and run.has(extra) else 1, width=11 if extra and run.has(extra) else 8)
    _line(axes[0, 0], run.steps, run.values(key), window, key, "C0")
    axes[0, 0].set(title=title, xlabel="step", ylabel=key)
    if axes.shape[1] == 2:
        _line(axes[0, 1], run.steps, run.values(extra), window, extra, "C1")
        axes[0, 1].set(title=extra, xlabel="step", ylabel=extra)
    return fig


def _plot_mismatch(run: Run, window: int):
    keys = [f"rollout_correction/{m}" for m in MISMATCH_METRICS if run.has(f"rollout_correction/{m}")]
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = _figure(nrows, ncols, width=4.0 * ncols, height=3.0 * nrows + 0.4)
    fig.suptitle("training–inference mismatch (rollout_correction/*)")
    for i, ax in enumerate(axes.flat):
        if i >= len(keys):
            ax.set_visible(False)
            continue
        _line(ax, run.steps, run.values(keys[i]), window, None, f"C{i}")
        ax.set(title=keys[i].split("/", 1)[1], xlabel="step")
    return fig


def _plot_phases(run: Run, window: int):
    phases = run.phases()
    series = [[v if math.isfinite(v) else 0.0 for v in run.values(p)] for p in phases]
    labels = [p.removeprefix("time/") for p in phases]
    if run.has("time/step"):  # what the phases do not account for (logging, checkpoints, data loading)
        other = [max(0.0, t - sum(col)) if math.isfinite(t) else 0.0
                 for t, col in zip(run.values("time/step"), zip(*series))]
        if any(o > 1e-3 for o in other):
            series.append(other)
            labels.append("other")
    if window > 1:
        series = [_smooth(s, window) for s in series]
    fig, axes = _figure()
    ax = axes[0, 0]
    ax.stackplot(run.steps, series, labels=labels, alpha=0.85, step="mid" if len(run.rows) <= 60 else None)
    ax.set(title="time per phase (stacked)", xlabel="step", ylabel="seconds")
    fig.legend(loc="outside lower center", fontsize="small", ncols=min(6, len(labels)))
    return fig


def plot_specs(run: Run) -> list[tuple[str, str | None]]:
    """(file name, why it is skipped or None) for every plot; a plot is skipped when its metrics are absent."""
    mismatch = any(run.has(f"rollout_correction/{m}") for m in MISMATCH_METRICS)
    return [
        ("reward.png", None if run.has("reward/mean") else "no reward/mean logged"),
        ("kl.png", None if run.has("kl") else "no kl logged (β = 0: no reference model)"),
        ("loss.png", None if run.has("loss") else "no loss logged"),
        ("mismatch.png", None if mismatch else "no rollout_correction/* metrics logged"),
        ("phases.png", None if run.phases() else "no time/* phases logged"),
    ]


def write_plots(run: Run, out_dir: Path, *, window: int | None = None, dpi: int = 110) -> tuple[list[Path], dict[str, str]]:
    """Write the PNGs whose metrics exist; return (written paths, {skipped file: reason})."""
    window = auto_window(len(run.rows)) if window is None or window < 1 else window
    draw = {
        "reward.png": lambda: _plot_reward(run, window),
        "kl.png": lambda: _plot_single(run, window, "kl", "KL to the reference policy"),
        "loss.png": lambda: _plot_single(run, window, "loss", "loss", extra="grad_norm"),
        "mismatch.png": lambda: _plot_mismatch(run, window),
        "phases.png": lambda: _plot_phases(run, window),
    }
    written, skipped = [], {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, why in plot_specs(run):
        if why:
            skipped[name] = why
            continue
        fig = draw[name]()
        path = out_dir / name
        tmp = path.with_suffix(".tmp.png")  # a viewer refreshing a running run never sees half a file
        fig.savefig(tmp, dpi=dpi)
        tmp.replace(path)
        written.append(path)
    return written, skipped
