"""Exact resume: a run killed (SIGKILL), interrupted (SIGINT) or hung up (SIGHUP: its terminal closed) and resumed
ends with the same parameters as an uninterrupted run with the same seed, in sync mode (tiny-cpu), in async mode
(tiny-cpu-async: the batches in flight at the checkpoint are saved and restored, the Ray rollout actor is
re-synced), and sharded: fsdp2 (DCP shards) and DeepSpeed ZeRO-3 (its own per-rank files) on 2 gloo processes with
vLLM colocated, the whole process tree killed, as when a node dies, and Megatron at tensor parallel 2 (its
dist_checkpointing shards, the hf engine's own copy re-synced from them); and a LoRA policy, on ddp (tiny-cpu-lora) and
fsdp2 (the checkpoint holds the adapter and its optimizer state, the frozen base is read again; the adapter is
compared; the ddp one also distils from a local teacher, `algorithm.distill`, reloaded rather than checkpointed).
SIGINT and SIGHUP take the same save path as each other, so the sharded and LoRA variants run SIGKILL
only and SIGHUP runs in sync mode only, in the extended run (CI time; see EXTENDED)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

STEPS = 6
STOP_AFTER = 4
"""The interrupted run is stopped once checkpoint-4 is written (checkpoints every 2 steps: the resumed run picks the
latest of two) and resumes for the last 2 steps, each of which repeats the uninterrupted run's only if the weights,
optimizer moments, scheduler, RNG and data cursor all came back."""
BASE = ["--set", f"train.steps={STEPS}", "--set", "train.prompts_per_step=4", "--set", "train.micro_batch_size=16",
        "--set", "eval.every_steps=0"]  # no held-out eval: only the final weights are compared


VARIANTS = {
    "tiny-cpu": ["--preset", "tiny-cpu"],
    "tiny-cpu-async": ["--preset", "tiny-cpu-async"],
    "fsdp2": ["--preset", "tiny-cpu-vllm", "--set", "distributed.num_processes=2", "--set", "distributed.backend=fsdp2"],
    "zero3": ["--preset", "tiny-cpu-vllm", "--set", "distributed.num_processes=2",
              "--set", "distributed.backend=deepspeed", "--set", "distributed.deepspeed.zero_stage=3"],
    "megatron": ["--preset", "tiny-cpu", "--set", "distributed.num_processes=2",
                 "--set", "distributed.backend=megatron", "--set", "distributed.megatron.tensor_parallel=2"],
    "tiny-cpu-lora": ["--preset", "tiny-cpu-lora",
                      "--set", "algorithm.distill={teacher: 'builtin:tiny', coef: 0.5}"],
    "fsdp2-lora": ["--preset", "tiny-cpu-vllm", "--set", "distributed.num_processes=2", "--set",
                   "distributed.backend=fsdp2", "--set", "model.lora={modules_to_save: [lm_head]}"],
    "fsdp2-sp2": ["--preset", "tiny-cpu-vllm", "--set", "distributed.num_processes=2", "--set",
                  "distributed.backend=fsdp2", "--set", "distributed.sequence_parallel.size=2"],
}


def _cmd(variant: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "grpo_cli", "train", *VARIANTS[variant], "--output-dir", str(out), *BASE, *extra]


def _with_stop_signals_at_default(cmd: list[str]) -> list[str]:
    """`cmd` started with SIGINT and SIGHUP at their defaults, as in a terminal. A test runner started in the
    background (`cmd &` in a non-interactive shell ignores SIGINT) or under nohup (SIGHUP) would pass the ignore on,
    and grpo keeps a signal ignored at start ignored, by design (`train/supervise/signals.py`)."""
    reset = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "signal.signal(signal.SIGHUP, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-c", reset, *cmd]


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    """The consolidated float32 weights exported at the end (the same for every backend); for a LoRA run, the
    exported adapter (and modules_to_save)."""
    if (run / "final-adapter").exists():
        return load_file(run / "final-adapter" / "adapter_model.safetensors")
    return load_file(run / "final-model" / "model.safetensors")


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"{path} never appeared; the run printed:\n{log.read_text()[-4000:]}"
        time.sleep(0.02)


def _signal_tree(pid: int, sig: int) -> None:
    """SIGINT to the process group, as Ctrl-C sends it (launchers forward it to their workers); SIGKILL to every
    process of the tree at once, as when the machine dies (torchrun's workers run in sessions of their own)."""
    if sig != signal.SIGKILL:
        os.killpg(pid, sig)
        return
    import psutil

    parent = psutil.Process(pid)
    for p in [*parent.children(recursive=True), parent]:
        p.send_signal(sig)


CASES = [("tiny-cpu", signal.SIGKILL), ("tiny-cpu", signal.SIGINT), ("tiny-cpu", signal.SIGHUP),
         ("tiny-cpu-async", signal.SIGKILL), ("tiny-cpu-async", signal.SIGINT),
         ("fsdp2", signal.SIGKILL), ("zero3", signal.SIGKILL), ("megatron", signal.SIGKILL),
         ("tiny-cpu-lora", signal.SIGKILL), ("fsdp2-lora", signal.SIGKILL), ("fsdp2-sp2", signal.SIGKILL)]
EXTENDED = {("tiny-cpu-async", signal.SIGINT), ("fsdp2", signal.SIGKILL), ("megatron", signal.SIGKILL),
            ("tiny-cpu", signal.SIGHUP), ("fsdp2-sp2", signal.SIGKILL)}
"""Left out of the default run (CI time; `pytest -m extended`): SIGINT's save path runs in sync mode, async resume
under SIGKILL, and fsdp2's sharded resume in the fsdp2-lora case. SIGHUP (19 s): it sets the same stop request as
SIGINT (tests/train/test_signals.py: SIGHUP is a stop request, said as the terminal closing, kept ignored under
nohup), whose stop → save → exit 0 → resume path, train.log line included, runs in the tiny-cpu SIGINT case.
Megatron (58 s): `grpo train` resuming from its dist_checkpointing shards, the hf engine re-synced from them, bit for
bit, runs in
tests/train/test_megatron_run.py::test_resumed_run_equals_the_uninterrupted_one, `save_state`/`load_state` in every
layout in tests/train/test_megatron.py, and the SIGKILL of a 2-process launch tree in the zero3 and fsdp2-lora cases.
fsdp2 at sequence parallel 2 (its embedding and output layer in a unit of their own, trained vocabulary-parallel):
the same DCP shards and names, the step checked against the whole batch's in tests/train/test_sequence_parallel.py."""


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """The uninterrupted run of each variant, made on first use."""
    runs: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in runs:
            tmp = tmp_path_factory.mktemp("ref")
            subprocess.run(_cmd(variant, tmp / "run"), check=True, env=_env(tmp), cwd=tmp, capture_output=True,
                           timeout=600)
            runs[variant] = tmp / "run"
        return runs[variant]

    return get


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, worst


@pytest.mark.slow
@pytest.mark.parametrize("preset,sig", [pytest.param(v, s, marks=[pytest.mark.extended] if (v, s) in EXTENDED else [],
                                                  id=f"{v}-{s.name}") for v, s in CASES])
def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, reference_runs, preset, sig):
    run = tmp_path / "run"
    log = tmp_path / "interrupted.log"  # a file, not a pipe: nobody reads a pipe while waiting, and a full one blocks
    with log.open("w") as sink:
        proc = subprocess.Popen(_with_stop_signals_at_default(_cmd(preset, run, "--set", "checkpoint.every_steps=2")),
                                env=_env(tmp_path),
                                cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        _wait_for(run / f"checkpoint-{STOP_AFTER}" / "MANIFEST.json", proc, log)
        _signal_tree(proc.pid, sig)
        proc.wait(timeout=120)
    out = log.read_text()
    if sig in (signal.SIGINT, signal.SIGHUP):
        assert proc.returncode == 0, out
        assert "stopped by signal" in out
        stop_line = f"stopped by signal {signal.Signals(sig).name}"
        assert stop_line in (run / "train.log").read_text()  # the log outlives the terminal
        saved = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
        from grpo_cli.train.checkpoint import verify_checkpoint

        assert verify_checkpoint(saved)["step"] >= STOP_AFTER  # complete (every file checksummed), after the signal
    assert not (run / f"checkpoint-{STEPS}").exists(), "the run was meant to stop early"
    resumed = subprocess.run(_cmd(preset, run, "--set", "checkpoint.resume=auto"), env=_env(tmp_path), cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "data cursor" in resumed.stdout
    if preset == "tiny-cpu-async":
        assert "1 rollout batch(es) in flight restored" in resumed.stdout, resumed.stdout
    _assert_same(_weights(run), _weights(reference_runs(preset)))
