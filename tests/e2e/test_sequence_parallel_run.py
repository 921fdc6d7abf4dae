"""`grpo train --nproc 2 --set distributed.sequence_parallel.size=2` trains the default preset and its reward rises:
Ulysses on ddp (default run), ring, and fsdp2 (colocated vLLM, since the hf engine cannot share sharded weights)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_env import clean_env


def _train(tmp_path, *overrides: str) -> dict:
    env = clean_env(GRPO_CLI_CACHE=str(tmp_path / "cache"), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                    VLLM_CPU_KVCACHE_SPACE="1")
    sets = [a for o in ("distributed.sequence_parallel.size=2", *overrides) for a in ("--set", o)]
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "--nproc", "2", *sets, "--output-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["dist/sequence_parallel"] == 2.0  # the trainer ran with its sequence-parallel group
    assert summary["reward_last_10pct"] > summary["reward_first_10pct"] + 2.0, summary
    return summary


@pytest.mark.slow
def test_ulysses_on_ddp_learns(tmp_path):
    _train(tmp_path)


# extended: the ring attention's forward and backward (and fsdp2 under it) are checked against the unsharded
# computation by tests/train/test_sequence_parallel.py (default run); this is the whole loop with it
@pytest.mark.extended
def test_ring_learns(tmp_path):
    _train(tmp_path, "distributed.sequence_parallel.style=ring")


# extended: fsdp2's sequence-parallel step is checked by tests/train/test_sequence_parallel.py::
# test_backend_step_reduces_the_whole_batch_gradient (default run); this adds colocated vLLM generation (~1 min)
@pytest.mark.extended
@pytest.mark.vllm
def test_fsdp2_learns(tmp_path):
    pytest.importorskip("vllm")
    _train(tmp_path, "distributed.backend=fsdp2", "rollout.engine=vllm", "rollout.vllm.kv_cache_space_gib=1")
