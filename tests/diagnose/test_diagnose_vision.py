"""`grpo diagnose-mismatch` on a vision-language model (the built-in tiny Qwen2-VL, `builtin:shapes` image prompts,
hf engine, fp32 on both sides): the engine samples with each prompt's image and the training side recomputes with
the same image rows, and the report's numbers equal the algorithm core's on the reported tokens. The one mismatch
left is by design: the engine never samples an image/video placeholder token, so its sampler logprobs are of the
distribution renormalised without them, and every token's log ρ = log π_train − log π_sampler = log(1 − p_banned)
is slightly negative (2 of the tiny vocabulary's 64 ids: ≈ −0.024). Without the images on either side the two would
be logprobs of different inputs, off by far more and of either sign."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import build_config


@pytest.mark.slow  # 25 s with the machine at load 8 on 2 cores: the CLI, the tiny VLM, 2 prompts × 2
def test_diagnose_mismatch_on_image_prompts_leaves_only_the_placeholder_ban(tmp_path, reported, recompute, validate_report):
    out = tmp_path / "vlm.json"
    result = CliRunner().invoke(app, [
        "diagnose-mismatch", "--num-prompts", "2", "--set", "model.name_or_path=builtin:tiny-vlm",
        "--set", "data.source=builtin:shapes", "--set", "train.generations_per_prompt=2", "--set", "train.micro_batch_size=4",
        "--set", "rollout.max_completion_length=4", "--engine", "hf", "--rollout-dtype", "fp32",
        "--json", str(out), "--with-tokens"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    validate_report(report)
    m = reported(report)
    log_rho = [t - r for s in report["samples"] for t, r in zip(s["train_logprobs"], s["rollout_logprobs"])]
    assert log_rho and all(-0.06 < x < 0 for x in log_rho), log_rho
    assert report["setup"]["model"].endswith("tiny-vlm-v1") and report["setup"]["num_tokens"] > 0
    algorithm = build_config("tiny-cpu").algorithm
    assert recompute(report, algorithm) == pytest.approx(m, rel=1e-6, abs=1e-9)
