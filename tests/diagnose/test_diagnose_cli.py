"""`grpo diagnose-mismatch` end to end on the tiny checkpoint with the hf engine (CliRunner, in-process): fp32 on both
sides reads ~0, a bf16 rollout copy reads clearly non-zero, --json validates, --fail-above/--fail-below exit 1/0/2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import build_config

runner = CliRunner()


def _run(args: list[str]):
    return runner.invoke(app, ["diagnose-mismatch", "--num-prompts", "4", *args])


@pytest.fixture(scope="module")
def fp32_report(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("diag") / "fp32.json"
    result = _run(["--set", f"model.name_or_path={tiny_checkpoint}", "--engine", "hf", "--rollout-dtype", "fp32",
                   "--json", str(out), "--with-tokens", "--fail-above", "k3_kl=1e-3", "--fail-below", "ess=0.999"])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


@pytest.fixture(scope="module")
def bf16_report(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("diag") / "bf16.json"
    result = _run(["--set", f"model.name_or_path={tiny_checkpoint}", "--rollout-dtype", "bf16", "--json", str(out),
                   "--with-tokens", "--fail-above", "rollout_correction/log_ppl_abs_diff=0"])
    assert result.exit_code == 1, result.output
    return json.loads(out.read_text()), result.output


def test_same_fp32_checkpoint_reads_near_zero(fp32_report, reported, validate_report):
    report, output = fp32_report
    m = reported(report)
    assert abs(m["kl"]) < 1e-5 and m["k3_kl"] < 1e-5 and m["ess"] > 0.999 and m["ess_seq"] > 0.999
    assert report["log_ratio"]["abs_max"] < 1e-4
    assert report["setup"]["rollout_dtype"] == report["setup"]["training_dtype"] == "float32"
    assert report["overall"] == "ok" and all(not g["failed"] for g in report["gates"])
    validate_report(report)
    for needle in ("rollout_correction/ metrics", "k3_kl", "per-token log ρ", "worst tokens", "overall:",
                   "gate k3_kl > 0.001"):
        assert needle in output


def test_bf16_rollout_reads_clearly_nonzero(bf16_report, fp32_report, reported, validate_report):
    report, output = bf16_report
    m, base = reported(report), reported(fp32_report[0])
    assert report["setup"]["rollout_dtype"] == "bfloat16" and report["setup"]["training_dtype"] == "float32"
    assert report["log_ratio"]["abs_max"] > 1e-4 and report["log_ratio"]["abs_p50"] > 1e-5
    assert m["log_ppl_abs_diff"] > 1e-5 and m["log_ppl_abs_diff"] > 100 * base["log_ppl_abs_diff"]
    assert m["k3_kl"] > 1e-8 and m["k3_kl"] > 100 * base["k3_kl"]
    assert [g["failed"] for g in report["gates"]] == [True]
    assert "FAILED" in output
    validate_report(report)


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_reported_numbers_equal_the_core_on_the_sampled_tensors(which, fp32_report, bf16_report, recompute,
                                                                reported):
    report = (fp32_report if which == "fp32" else bf16_report)[0]
    algorithm = build_config("tiny-cpu").algorithm
    assert recompute(report, algorithm) == pytest.approx(reported(report), rel=1e-6, abs=1e-9)
    tokens = sum(len(s["completion_ids"]) for s in report["samples"])
    assert tokens == report["setup"]["num_tokens"] and len(report["samples"]) == 4 * 8


def test_checkpoint_option_evaluates_a_saved_folder(tiny_checkpoint, tmp_path):
    out = tmp_path / "ckpt.json"
    result = _run(["--checkpoint", tiny_checkpoint, "--num-prompts", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["setup"]["model"] == tiny_checkpoint


@pytest.mark.parametrize("args,needle", [
    (["--fail-above", "k3=1e-3"], "k3_kl, chi2_token"),
    (["--fail-above", "k3_kl"], "expected METRIC=VALUE"),
    (["--fail-below", "ess=high"], "not a number"),
    (["--checkpoint", "/no/such/dir"], "no Hugging Face model found"),
    (["--engine", "server"], "rollout.server.urls is empty"),
])
def test_bad_input_exits_2_naming_the_fix(args, needle):
    result = _run(args)
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_print_schema_is_the_documented_schema():
    from grpo_cli.diagnose.rules import report_schema

    result = runner.invoke(app, ["diagnose-mismatch", "--print-schema"])
    assert result.exit_code == 0 and json.loads(result.output) == report_schema()
