"""The verdict rules of `grpo diagnose-mismatch`: each `rollout_correction/` metric's thresholds (OK / watch /
correct), the gates of `--fail-above/--fail-below`, the recommendation's search grids and budgets, and the
`--json` schema. Pure: no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, NamedTuple

from grpo_cli.train.supervise.alarms import K3_KL_ALARM

SCHEMA_PATH = Path(__file__).with_name("diagnose_schema.json")
Verdict = Literal["ok", "watch", "correct", "info"]
VERDICT_ORDER = ("info", "ok", "watch", "correct")


class Rule(NamedTuple):
    """Verdict rule of one metric: `kind` above (x), abs (|x|), dev1 (|x − 1|) grow with mismatch, below (x)
    shrinks with it; `watch`/`correct` are where the verdict turns; `info` metrics get no verdict."""

    kind: Literal["above", "abs", "dev1", "below", "info"]
    watch: float
    correct: float
    meaning: str


# Defaults chosen so that the same weights in the same dtype read OK, a bf16 engine on a dense model reads
# OK-to-watch (reported k1/k3 of healthy bf16 runs are ~1e-4..2e-3), and "correct it" starts where the training
# alarm fires (K3_KL_ALARM); χ² ≈ 2·KL for small mismatch, hence the doubled bounds. χ² is judged by |x|: with
# top-p/top-k the ratios are not normalised and a systematic shift reads as a large negative χ².
RULES: dict[str, Rule] = {
    "kl": Rule("abs", 1e-3, K3_KL_ALARM, "k1 KL(rollout‖train), token mean"),
    "k3_kl": Rule("above", 1e-3, K3_KL_ALARM, "k3 KL(rollout‖train), token mean, ≥ 0"),
    "chi2_token": Rule("abs", 2e-3, 2 * K3_KL_ALARM, "mean ρ² − 1 over tokens"),
    "chi2_seq": Rule("abs", 0.1, 1.0, "χ² of the sequence (product) ratio"),
    "chi2_seq_geo": Rule("abs", 2e-3, 2 * K3_KL_ALARM, "χ² of the per-sequence geometric ratio"),
    "ess": Rule("below", 0.99, 0.9, "effective sample size / N, tokens"),
    "ess_seq": Rule("below", 0.99, 0.9, "effective sample size / N, sequences"),
    "is_weight_mean": Rule("dev1", 1e-2, 5e-2, "mean weight of the configured correction"),
    "clipped_frac": Rule("above", 1e-3, 1e-2, "tokens the configured correction cuts"),
    "log_ppl_diff": Rule("abs", 1e-2, 5e-2, "mean log(PPL_train / PPL_rollout)"),
    "log_ppl_abs_diff": Rule("above", 1e-2, 5e-2, "mean |log(PPL_train / PPL_rollout)|"),
    "log_ppl_diff_max": Rule("abs", 5e-2, 0.2, "largest per-sequence log PPL ratio"),
    "log_ppl_diff_min": Rule("abs", 5e-2, 0.2, "smallest per-sequence log PPL ratio"),
    "ppl_ratio": Rule("dev1", 1e-2, 5e-2, "mean per-sequence PPL_train/PPL_rollout"),
    "training_ppl": Rule("info", 0, 0, "perplexity under the trainer"),
    "training_log_ppl": Rule("info", 0, 0, "NLL per token under the trainer"),
    "rollout_ppl": Rule("info", 0, 0, "perplexity under the engine"),
    "rollout_log_ppl": Rule("info", 0, 0, "NLL per token under the engine"),
}
METRIC_NAMES: tuple[str, ...] = tuple(RULES)
"""The `rollout_correction/` metric names (without the prefix); a test pins them to the algorithm core's."""

# Grids the recommendation searches; the geometric mean of per-token ratios lives close to 1 (NeMo/verl presets
# use 0.999–1.002), so its grid is much tighter than the token and product ones.
OPTION_GRID: dict[str, tuple[float, ...]] = {
    "token": (1.5, 2.0, 3.0, 5.0),
    "sequence_product": (2.0, 3.0, 5.0, 10.0),
    "sequence_geometric": (1.001, 1.002, 1.01, 1.05, 1.1),
}
MASK_BUDGET_TOKENS = 0.01
"""A token mask is recommended only at a threshold that drops at most this fraction of tokens."""
MASK_BUDGET_SEQUENCES = 0.10
"""A sequence mask is recommended only at a threshold that drops at most this fraction of sequences."""


def report_schema() -> dict:
    """The documented JSON schema of the `--json` report (draft 2020-12; every object closed to extra keys)."""
    return json.loads(SCHEMA_PATH.read_text())


# ---- verdicts and gates ----------------------------------------------------------------------------------


def verdict(name: str, value: float) -> Verdict:
    """OK / watch / correct of one metric per `RULES`."""
    rule = RULES[name]
    if rule.kind == "info":
        return "info"
    if rule.kind == "below":
        return "ok" if value >= rule.watch else "watch" if value >= rule.correct else "correct"
    x = {"above": value, "abs": abs(value), "dev1": abs(value - 1.0)}[rule.kind]
    return "ok" if x < rule.watch else "watch" if x < rule.correct else "correct"


def rule_text(name: str) -> str:
    """The verdict thresholds of one metric as text."""
    rule = RULES[name]
    if rule.kind == "info":
        return "-"
    if rule.kind == "below":
        return f"x: OK ≥ {rule.watch:g}, watch ≥ {rule.correct:g}"
    x = {"above": "x", "abs": "|x|", "dev1": "|x−1|"}[rule.kind]
    return f"{x}: OK < {rule.watch:g}, watch < {rule.correct:g}"


def worst(verdicts: list[Verdict]) -> Verdict:
    """The most severe verdict (info < ok < watch < correct)."""
    return max(verdicts, key=VERDICT_ORDER.index, default="ok")


def check_gates(metrics: dict[str, float], *, above: dict[str, float], below: dict[str, float]) -> list[dict]:
    """One entry per gate; a gate fails when the metric is strictly above (below) its limit."""
    gates = [dict(metric=m, op="above", limit=v, value=metrics[m], failed=metrics[m] > v) for m, v in above.items()]
    return gates + [dict(metric=m, op="below", limit=v, value=metrics[m], failed=metrics[m] < v)
                    for m, v in below.items()]
