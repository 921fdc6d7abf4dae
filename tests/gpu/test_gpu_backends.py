"""Training backends on GPUs: fsdp2 and ZeRO-3 at world size 1 in bf16 through `grpo train`; on two GPUs, DDP, fsdp2
and ZeRO-3 over NCCL match one process (the CPU suite shows the same over gloo); the first used-by preset when its
model can be had."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_helpers import gpu_env, grpo, needs_two, sets, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
E2E = Path(__file__).parents[1] / "e2e"
WORKER = str(E2E / "dp_worker.py")
BACKENDS = {
    "ddp": [],
    "fsdp2": ["distributed.backend=fsdp2", "rollout.engine=vllm"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm"],
}


@pytest.mark.parametrize("backend", ["fsdp2", "zero3"])
def test_sharded_backend_world_1_bf16_trains(tmp_path, backend):
    grpo(tmp_path, "train", "--preset", "tiny-cpu-vllm", "--output-dir", str(tmp_path / "run"),
         *sets("distributed.device=cuda", "model.dtype=bfloat16", "train.steps=3", *BACKENDS[backend]))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["backend"] == ("deepspeed" if backend == "zero3" else backend)
    assert (tmp_path / "run" / "final-model" / "config.json").exists()


def _worker(tiny_checkpoint: str, out: Path, procs: int, backend: str) -> dict:
    cmd = [WORKER] if procs == 1 else torchrun(procs, WORKER)
    if procs == 1:
        cmd = [sys.executable, *cmd]
    subprocess.run([*cmd, tiny_checkpoint, str(out), "token_mean", *BACKENDS[backend]], check=True, timeout=900,
                   env=gpu_env(DP_WORKER_DEVICE="cuda", NVIDIA_TF32_OVERRIDE="0", MASTER_ADDR="127.0.0.1",
                               PYTHONPATH=os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")])))
    return load_file(out)


@needs_two
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_gpus_match_one(tmp_path, tiny_checkpoint, backend):
    one = _worker(tiny_checkpoint, tmp_path / "one.safetensors", 1, backend)
    two = _worker(tiny_checkpoint, tmp_path / "two.safetensors", 2, backend)
    worst = max(float((one[k].float() - two[k].float()).abs().max()) for k in one)
    assert worst < 1e-4, worst


def _local_model(name: str) -> str | None:
    """A local copy of `name`: $GRPO_GPU_MODEL_<NAME> or the Hugging Face cache (never a download)."""
    env = os.environ.get("GRPO_GPU_MODEL_" + name.split("/")[-1].upper().replace("-", "_").replace(".", "_"))
    if env and Path(env).exists():
        return env
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:
        return None


def _cached_gsm8k() -> bool:
    """Whether the preset's data set loads without a download (offline Hugging Face cache)."""
    code = "from grpo_cli.data.sources import load_rows; load_rows('hf:openai/gsm8k', seed=0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300,
                          env=gpu_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
    return proc.returncode == 0


def test_first_used_by_preset_runs_three_steps(tmp_path):
    path = _local_model("Qwen/Qwen2.5-1.5B-Instruct")
    if path is None or not _cached_gsm8k():
        pytest.skip("Qwen2.5-1.5B-Instruct or openai/gsm8k not in the local cache (set "
                    "GRPO_GPU_MODEL_QWEN2_5_1_5B_INSTRUCT, or download both once)")
    grpo(tmp_path, "train", "--preset", "qwen-1.5b-colocate", "--output-dir", str(tmp_path / "run"),
         *sets("train.steps=3", f"model.name_or_path={path}", "checkpoint.every_steps=0"), timeout=1800, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
