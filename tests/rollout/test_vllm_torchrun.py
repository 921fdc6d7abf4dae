"""2-process colocate run on CPU: `torchrun --nproc_per_node 2` (gloo), a vLLM engine with the external launcher
in each process (TP 1: two engines; TP 2: one engine over both), generate → optimizer step → verified sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_env import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
WORKER = Path(__file__).with_name("vllm_dist_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tp", [1, 2])
def test_two_process_colocate_generate_and_sync(tiny_checkpoint, tmp_path, tp):
    pytest.importorskip("vllm")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(WORKER), tiny_checkpoint, str(tp), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["completions"] for r in results] == [4, 6]  # each rank got its own prompts' completions back
    for r in results:
        assert r["parity_before"] < 1e-4 and r["parity_after"] < 1e-4
        assert r["weight_version"] == 1
        assert r["sync"]["sync/max_probe_diff"] < 1e-4 and r["sync"]["sync/checked_tensors"] >= 1
