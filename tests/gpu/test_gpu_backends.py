"""Training backends on one GPU with torch alone (no vLLM): ddp, fsdp2 (one process, no launcher), ZeRO-2, ZeRO-3 and
megatron at world size 1 in bf16 through `grpo train`, 2 steps, then a resume to step 3. fsdp2 and ZeRO-3 shard the
policy, so they generate from `grpo serve-rollout --engine hf` on the same GPU. On two GPUs, DDP, fsdp2 and ZeRO-3
over NCCL match one process (the CPU suite shows the same over gloo); the first used-by preset needs vLLM and its
model in the local cache."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_helpers import DEVICE, ON_CPU, gpu_env, grpo, hf_server, needs_two, needs_vllm, sets, step_metrics, summary, torchrun
from safetensors.torch import load_file

E2E = Path(__file__).parents[1] / "e2e"
WORKER = str(E2E / "dp_worker.py")
BACKENDS = {
    "ddp": [],
    "fsdp2": ["distributed.backend=fsdp2", "rollout.engine=vllm"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm"],
}
"""For the two-GPU parity worker (it builds no engine; `rollout.engine=vllm` only satisfies the config rules)."""

ONE_GPU = {
    "ddp": [],
    "zero2": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=2"],
    "megatron": ["distributed.backend=megatron"],
    "fsdp2": ["distributed.backend=fsdp2"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3"],
}
SERVED = {"fsdp2", "zero3"}
"""Sharded at world size 1 too: they generate from a rollout server instead of the policy's own parameters."""
BASE = [f"distributed.device={DEVICE}", "model.dtype=bfloat16", "eval.every_steps=0", "checkpoint.every_steps=2",
        "train.prompts_per_step=4", "train.generations_per_prompt=4", "train.micro_batch_size=8"]


@pytest.mark.parametrize("backend", list(ONE_GPU))
def test_backend_world_1_bf16_trains_and_resumes(tmp_path, backend):
    run = tmp_path / "run"
    with (hf_server(tmp_path) if backend in SERVED else contextlib.nullcontext()) as url:
        served = ["rollout.mode=server", f'rollout.server.urls=["{url}"]'] if url else []
        args = ["train", "--output-dir", str(run), *sets(*BASE, *ONE_GPU[backend], *served)]
        grpo(tmp_path, *args, *sets("train.steps=2"))
        assert summary(run)["steps"] == 2 and (run / "checkpoint-2").is_dir()
        resumed = grpo(tmp_path, *args, *sets("train.steps=3", "checkpoint.resume=auto"))
    assert "resumed from" in resumed.stdout, resumed.stdout[-3000:]
    done = summary(run)
    assert done["steps"] == 3 and done["backend"] == ("deepspeed" if backend.startswith("zero") else backend)
    records = step_metrics(run)
    assert [r["step"] for r in records][-1] == 3
    if not ON_CPU:
        assert all(r["memory/cuda_peak_allocated_mb"] > 0 for r in records)


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


@needs_vllm
def test_first_used_by_preset_runs_three_steps(tmp_path):
    path = _local_model("Qwen/Qwen2.5-1.5B-Instruct")
    if path is None or not _cached_gsm8k():
        pytest.skip("Qwen2.5-1.5B-Instruct or openai/gsm8k not in the local cache (set "
                    "GRPO_GPU_MODEL_QWEN2_5_1_5B_INSTRUCT, or download both once)")
    grpo(tmp_path, "train", "--preset", "qwen-1.5b-colocate", "--output-dir", str(tmp_path / "run"),
         *sets("train.steps=3", f"model.name_or_path={path}", "checkpoint.every_steps=0"), timeout=1800, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    assert summary(tmp_path / "run")["steps"] == 3
