"""Weight sync from shards is bounded by the bucket: streaming an ~80 MB fsdp2 model (2 gloo processes) to an engine
in 4 MB buckets grows a rank's resident memory by a few MB, while gathering the whole model grows it by the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dist_env import clean_env, free_port

WORKER = str(Path(__file__).with_name("sync_memory_worker.py"))
BUCKET_MB = 4


@pytest.fixture(scope="module")
def mid_checkpoint(tmp_path_factory) -> str:
    from grpo_cli.models.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("mid") / "ckpt", hidden_size=512, num_layers=8))


@pytest.mark.slow
@pytest.mark.parametrize("backend", [["distributed.backend=fsdp2"]])
def test_sync_stream_memory_is_bounded_by_the_bucket(tmp_path, mid_checkpoint, backend):
    out = tmp_path / "mem.json"
    env = clean_env(MASTER_ADDR="127.0.0.1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                    "--master_addr=127.0.0.1", WORKER, mid_checkpoint, str(out), str(BUCKET_MB), *backend],
                   check=True, timeout=300, env=env)
    mem = json.loads(out.read_text())
    assert mem["model_mb"] > 60 and abs(mem["sent_mb"] - mem["model_mb"]) < 1e-6, mem  # every tensor, whole
    assert mem["whole_model_growth_mb"] >= 0.9 * mem["model_mb"], mem  # the measurement sees a full gather
    assert mem["streamed_growth_mb"] <= 3 * BUCKET_MB, mem
