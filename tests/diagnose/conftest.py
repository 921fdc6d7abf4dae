"""Helpers shared by the diagnose-mismatch tests: schema validation and recomputing metrics from a report."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def validate_report():
    """Validate a report dict against grpo_cli/diagnose/diagnose_schema.json (jsonschema, draft 2020-12)."""
    jsonschema = pytest.importorskip("jsonschema")
    from grpo_cli.diagnose.rules import report_schema

    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)

    def check(report: dict) -> None:
        errors = sorted(validator.iter_errors(report), key=lambda e: list(e.path))
        assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]

    return check


def _recompute(report: dict, algorithm) -> dict[str, float]:
    """The algorithm core's mismatch metrics on the per-token logprobs a `--with-tokens` report carries."""
    import torch

    from grpo_cli.train.loss import MISMATCH_PREFIX, mismatch_metrics

    samples = report["samples"]
    width = max(len(s["completion_ids"]) for s in samples)
    train = torch.zeros(len(samples), width)
    rollout = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        n = len(s["completion_ids"])
        train[i, :n] = torch.tensor(s["train_logprobs"])
        rollout[i, :n] = torch.tensor(s["rollout_logprobs"])
        mask[i, :n] = 1.0
    out = mismatch_metrics(old_logprobs=train, sampler_logprobs=rollout, completion_mask=mask, algorithm=algorithm)
    return {name.removeprefix(MISMATCH_PREFIX): float(v) for name, v in out.items()}


@pytest.fixture(scope="session")
def recompute():
    """recompute(report, algorithm) -> the core's metrics on the report's `samples` (needs --with-tokens)."""
    return _recompute


def reported_values(report: dict) -> dict[str, float]:
    return {row["name"]: row["value"] for row in report["metrics"]}


@pytest.fixture(scope="session")
def reported():
    """reported(report) -> {metric name: value} as the report states them."""
    return reported_values
