"""HSDP (`distributed.fsdp2.replicate`) on one GPU: its mesh's subgroups carry NCCL, and fsdp2 on that 2-D mesh reads
its rows, steps in bf16 with clipping, gathers for weight sync on the GPU (also from host shards under
`cpu_offload`) and resumes from DCP (hsdp_worker.py). The mesh is 1 x 1: NCCL refuses two ranks on one GPU, so the
R > 1 shapes are tested over gloo on CPU (tests/train/test_hsdp.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from gpu_helpers import DEVICE, ON_CPU, gpu_env

WORKER = str(Path(__file__).with_name("hsdp_worker.py"))


def test_hsdp_mesh_on_one_gpu(tmp_path, tiny_checkpoint):
    proc = subprocess.run([sys.executable, WORKER, tiny_checkpoint, str(tmp_path), DEVICE], capture_output=True,
                          text=True, timeout=600, env=gpu_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    for name, r in result.items():
        assert r["placements"] == ["R", "S(0)"] and r["mesh_device"] == DEVICE, (name, r)
        assert ON_CPU or "nccl" in r["shard_backend"], (name, r)
        assert r["local_device"] == ("cpu" if name == "cpu_offload" else DEVICE), (name, r)
        assert r["read_rows"] and r["synced"] and r["resumed"], (name, r)
        assert r["sent_device"] == DEVICE and math.isfinite(r["loss"]) and r["grad_norm"] > 0, (name, r)
