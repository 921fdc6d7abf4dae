"""LoRA with a KL reference (β > 0) loads no second model: its RSS stays within 5% of β = 0, while full
fine-tuning's β > 0 adds a whole copy of the weights. RSS is read after the reference pass and an optimizer step,
once freed heap pages are returned (peak RSS also counts load-time buffers and varied by ±100 MB between runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
WORKER = Path(__file__).with_name("lora_memory_worker.py")


def _peak(ckpt: str, *sets: str) -> float:
    out = subprocess.run([sys.executable, str(WORKER), ckpt, *sets], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_mb"]


@pytest.mark.slow
def test_lora_reference_costs_no_second_model(tmp_path):
    from grpo_cli.models.tiny import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "m", hidden_size=768, num_layers=8))
    model_mb = (tmp_path / "m" / "model.safetensors").stat().st_size / 2**20  # ~190 MB of float32 weights
    lora = ["model.lora={r: 8, target_modules: [q_proj, v_proj]}"]
    lora_b0 = _peak(ckpt, *lora, "algorithm.kl.beta=0")
    lora_b1 = _peak(ckpt, *lora, "algorithm.kl.beta=0.04")
    full_b0 = _peak(ckpt, "algorithm.kl.beta=0")
    full_b1 = _peak(ckpt, "algorithm.kl.beta=0.04")
    assert lora_b1 <= 1.05 * lora_b0, (lora_b0, lora_b1)
    assert full_b1 - full_b0 > 0.8 * model_mb, (full_b0, full_b1, model_mb)  # what LoRA's reference saves
    print(f"RSS MB: lora β=0 {lora_b0:.0f}, β>0 {lora_b1:.0f}; full β=0 {full_b0:.0f}, β>0 {full_b1:.0f}; "
          f"model {model_mb:.0f}")
