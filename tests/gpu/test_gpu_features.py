"""Features on one GPU with torch alone: LoRA, tool calling, a reward model on CUDA, `grpo diagnose-mismatch
--engine hf`, the CUDA memory figures (per step, in `summary.json` and `grpo report`), and fsdp2's
`distributed.offload` lowering `torch.cuda.memory_allocated`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_helpers import DEVICE, ON_CPU, gpu_env, grpo, sets, step_metrics, summary

OFFLOAD_WORKER = str(Path(__file__).with_name("offload_worker.py"))
TESTS = Path(__file__).parents[1]
SHORT = [f"distributed.device={DEVICE}", "model.dtype=bfloat16", "train.steps=3", "eval.every_steps=0"]


@pytest.mark.parametrize("preset", ["tiny-cpu-lora", "tiny-cpu-tools"])
def test_preset_trains_on_the_gpu(tmp_path, preset):
    run = tmp_path / "run"
    grpo(tmp_path, "train", "--preset", preset, "--output-dir", str(run), *sets(*SHORT))
    assert summary(run)["steps"] == 3


def test_reward_model_on_the_gpu(tmp_path):
    """A local sequence classifier as a reward, on the training device in the compute dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo_cli.models.tiny import build_tokenizer

    rm = tmp_path / "rm"
    tok = build_tokenizer(rm, chars=True)
    torch.manual_seed(0)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)).save_pretrained(rm)
    config = tmp_path / "rm.yaml"
    config.write_text(json.dumps({"rewards": {"functions": [
        {"model": str(rm), "alias": "rm"}, {"name": "length", "kwargs": {"target": 4}}]}}))
    run = tmp_path / "run"
    grpo(tmp_path, "train", "--config", str(config), "--output-dir", str(run), *sets(*SHORT))
    records = step_metrics(run)
    assert len(records) == 3 and all("reward/rm/mean" in r for r in records)


def test_diagnose_mismatch_with_the_hf_engine(tmp_path):
    report = tmp_path / "report.json"
    grpo(tmp_path, "diagnose-mismatch", "--engine", "hf", "-n", "4", "--json", str(report),
         *sets(f"distributed.device={DEVICE}", "model.dtype=bfloat16"))
    text = report.read_text()
    assert "k3_kl" in text and "ess" in text


@pytest.mark.skipif(ON_CPU, reason="CUDA memory figures")
def test_memory_figures_reach_metrics_summary_and_report(tmp_path):
    run = tmp_path / "run"
    grpo(tmp_path, "train", "--output-dir", str(run), *sets(*SHORT))
    records = step_metrics(run)
    for key in ("memory/cuda_peak_allocated_mb", "memory/cuda_peak_reserved_mb"):
        assert all(r[key] > 0 for r in records), key
        assert summary(run)[key] >= max(r[key] for r in records) * 0.999, key
    shown = grpo(tmp_path, "report", str(run))
    assert "cuda_peak_allocated" in shown.stdout, shown.stdout[-3000:]


def test_fsdp2_offload_lowers_memory_allocated(tmp_path, tiny_checkpoint):
    """The offloaded optimizer state, gradients and parameters leave the device: `memory_allocated` falls by at
    least the bytes the meter reports moved (on the CPU run: every offloaded tensor is on the host)."""
    out = tmp_path / "offload.json"
    proc = subprocess.run([sys.executable, OFFLOAD_WORKER, tiny_checkpoint, str(out), DEVICE], capture_output=True,
                          text=True, timeout=600,
                          env=gpu_env(PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["moved_bytes"] > 0 and got["off_device"] == 0, got
    if not ON_CPU:
        assert got["allocated_before"] - got["allocated_offloaded"] >= 0.9 * got["moved_bytes"], got
        assert got["allocated_reloaded"] >= got["allocated_before"] * 0.9, got
