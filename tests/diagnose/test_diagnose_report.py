"""diagnose-mismatch analysis on synthetic logprobs (no model): the numbers are the algorithm core's, verdict rules,
histogram bins, gates, the recommendation rule and the report schema."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from grpo_cli.config.load import build_config
from grpo_cli.diagnose import command as dg
from grpo_cli.diagnose import rules
from grpo_cli.train.loss import MISMATCH_PREFIX, mismatch_metrics

G = 4


class _Tok:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def _sample(log_rho: torch.Tensor, lengths: list[int] | None = None, seed: int = 0) -> dg.Sample:
    """rollout logprobs in (-5, -0.1), train = rollout + log_rho on valid positions, 0 elsewhere."""
    b, t = log_rho.shape
    gen = torch.Generator().manual_seed(seed)
    rollout = -(torch.rand(b, t, generator=gen) * 4.9 + 0.1)
    lengths = lengths or [t] * b
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    zero = torch.zeros(b, t)
    train, rollout = torch.where(mask, rollout + log_rho, zero), torch.where(mask, rollout, zero)
    completions = [[(7 * i + j) % 50 for j in range(n)] for i, n in enumerate(lengths)]
    return dg.Sample([[1, 2, 3]] * (b // G), completions, G, train, rollout, mask)


def _setup(smp: dg.Sample, cfg, **kw) -> dict:
    base = dict(model="synthetic", engine="hf", mode="colocate", rollout_dtype="float32", training_dtype="float32",
                attn_implementation="sdpa", temperature=1.0, top_p=1.0, top_k=0, seed=0,
                num_prompts=len(smp.prompt_ids), generations_per_prompt=G, num_sequences=len(smp.completion_ids), num_tokens=int(smp.mask.sum()),
                is_correction=cfg.algorithm.is_correction.model_dump(), seconds=0.0)
    return base | kw


def _report(log_rho, cfg=None, **kw):
    cfg = cfg or build_config("tiny-cpu")
    smp = _sample(log_rho, **kw)
    return smp, cfg, dg.build_report(smp, _Tok(), _setup(smp, cfg), cfg, with_tokens=True)


def test_metric_names_are_the_cores():
    smp = _sample(torch.zeros(8, 5))
    out = mismatch_metrics(old_logprobs=smp.train, sampler_logprobs=smp.rollout, completion_mask=smp.mask,
                           algorithm=build_config("tiny-cpu").algorithm)
    assert {k.removeprefix(MISMATCH_PREFIX) for k in out} == set(rules.METRIC_NAMES)


def test_report_numbers_equal_the_core_on_the_same_tensors(validate_report, recompute, reported):
    log_rho = 0.05 * torch.randn(16, 12, generator=torch.Generator().manual_seed(1))
    smp, cfg, report = _report(log_rho, lengths=[12 - i % 5 for i in range(16)])
    core = mismatch_metrics(old_logprobs=smp.train, sampler_logprobs=smp.rollout, completion_mask=smp.mask,
                            algorithm=cfg.algorithm)
    assert reported(report) == {k.removeprefix(MISMATCH_PREFIX): float(v) for k, v in core.items()}
    assert recompute(report, cfg.algorithm) == pytest.approx(reported(report), rel=1e-6, abs=1e-9)
    assert [r["key"] for r in report["metrics"]] == [MISMATCH_PREFIX + n for n in rules.METRIC_NAMES]
    validate_report(report)
    worst = report["worst_tokens"][0]
    assert abs(worst["log_ratio"]) == pytest.approx(float((smp.train - smp.rollout)[smp.mask].abs().max()))
    assert worst["log_ratio"] == pytest.approx(worst["train_logprob"] - worst["rollout_logprob"], abs=1e-6)
    diffs = [abs(s["log_ppl_diff"]) for s in report["worst_sequences"]]
    assert diffs == sorted(diffs, reverse=True) and len(diffs) == 5


@pytest.mark.parametrize("name,value,expected", [
    ("k3_kl", 0.0, "ok"), ("k3_kl", 1e-3, "watch"), ("k3_kl", 1e-2, "correct"), ("kl", -5e-3, "watch"),
    ("ess", 0.995, "ok"), ("ess", 0.95, "watch"), ("ess", 0.5, "correct"), ("ppl_ratio", 0.9, "correct"),
    ("is_weight_mean", 1.001, "ok"), ("training_ppl", 1e6, "info"),
])
def test_verdict_rules(name, value, expected):
    assert rules.verdict(name, value) == expected


def test_histogram_uses_signed_decades():
    bins = dg.histogram(torch.tensor([0.0, 5e-7, -5e-7, -2e-3, 0.5, 3.0, -30.0], dtype=torch.float64))
    assert len(bins) == 15 and sum(b["count"] for b in bins) == 7
    by_range = {(b["lo"], b["hi"]): b["count"] for b in bins}
    assert by_range[(-1e-6, 1e-6)] == 3
    assert by_range[(-1e-2, -1e-3)] == 1 and by_range[(0.1, 1.0)] == 1
    assert by_range[(1.0, None)] == 1 and by_range[(None, -1.0)] == 1


def test_gates_fail_strictly_beyond_their_limit():
    gates = rules.check_gates({"k3_kl": 1e-3, "ess": 0.99}, above={"k3_kl": 1e-3}, below={"ess": 0.995})
    assert [(g["metric"], g["failed"]) for g in gates] == [("k3_kl", False), ("ess", True)]


def test_identical_logprobs_keep_the_configured_correction():
    cfg = build_config("tiny-cpu", overrides=["algorithm.is_correction.enabled=false"])
    _, _, report = _report(torch.zeros(8, 6), cfg=cfg)
    rec = report["recommendation"]
    assert report["overall"] == "ok" and rec["enabled"] is False and rec["overrides"] == []
    assert (rec["level"], rec["action"], rec["threshold"]) == ("token", "truncate", 2.0)


def test_small_spread_recommends_token_truncation():
    log_rho = 0.05 * torch.randn(64, 12, generator=torch.Generator().manual_seed(0))
    _, _, report = _report(log_rho)
    rec = report["recommendation"]
    assert report["overall"] == "watch"
    assert (rec["enabled"], rec["level"], rec["action"], rec["threshold"]) == (True, "token", "truncate", 2.0)


def test_rare_token_outliers_recommend_the_tightest_token_mask_within_budget():
    log_rho = torch.zeros(64, 200)
    log_rho[5, 17] = 5.0
    _, _, report = _report(log_rho)
    rec = report["recommendation"]
    assert report["overall"] == "correct"
    assert (rec["level"], rec["action"], rec["threshold"]) == ("token", "mask", 1.5)
    assert rec["tokens_affected"] == pytest.approx(1 / (64 * 200))
    assert "algorithm.is_correction.action=mask" in rec["overrides"]
    assert report["worst_tokens"][0]["sequence"] == 5 and report["worst_tokens"][0]["position"] == 17


def test_drifting_sequences_recommend_a_geometric_sequence_mask():
    log_rho = torch.zeros(64, 12)
    log_rho[:3] = 0.5  # 3 of 64 sequences drift as a whole
    _, _, report = _report(log_rho)
    rec = report["recommendation"]
    assert report["overall"] == "correct"
    assert (rec["level"], rec["action"], rec["threshold"]) == ("sequence_geometric", "mask", 1.001)
    assert rec["sequences_affected"] == pytest.approx(3 / 64)
    assert {s["sequence"] for s in report["worst_sequences"][:3]} == {0, 1, 2}


def test_broad_drift_falls_back_to_truncation_and_says_why():
    log_rho = torch.full((16, 12), 0.3)
    _, _, report = _report(log_rho)
    rec = report["recommendation"]
    assert (rec["level"], rec["action"], rec["threshold"]) == ("token", "truncate", 2.0)
    assert "budget" in rec["reason"]


def test_options_cover_the_grid_and_flag_the_configured_one():
    cfg = build_config("tiny-cpu", overrides=["algorithm.is_correction.lower=0.5"])
    _, _, report = _report(torch.zeros(8, 4), cfg=cfg)
    grid = sum(len(v) for v in rules.OPTION_GRID.values()) * 2
    assert len(report["options"]) == grid + 1
    mine = [o for o in report["options"] if o["configured"]]
    assert [(o["level"], o["action"], o["threshold"], o["lower"]) for o in mine] == [("token", "truncate", 2.0, 0.5)]


def test_cli_module_loads_without_torch():
    code = "import sys, grpo_cli.cli.diagnose, grpo_cli.diagnose.command; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
