"""The chunked output layer on the sharding backends the CPU runs (`chunked_backends_worker.py`): fsdp2 in one process
(the output projection, tied to the embedding, is sharded in the root group and unsharded only inside the root's
forward and backward: the hand-written backward on that weight) and DeepSpeed ZeRO-3 on 2 gloo ranks (the untied head
partitioned across them, gathered by its module hooks around the call and before its backward: the hand-written
backward too, so a bf16 head's gradient is summed over chunks in float32, tests/algo/test_chunked_head.py) give the
logprobs, entropy and every gradient of the full-logits path (float32, 1e-6).
ddp in one process is the plain module: tests/rollout/test_chunked_logprobs.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dist_env import clean_env, run_two_ranks

WORKER = str(Path(__file__).with_name("chunked_backends_worker.py"))


@pytest.mark.parametrize("backend, arch", [("fsdp2", "qwen2"), ("zero3", "llama")])
def test_sharded_backends_equal_the_full_logits_path(tmp_path, backend, arch):
    from grpo_cli.models.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / arch, arch=arch)  # ZeRO-3's partition loader reads untied heads
    if backend == "zero3":  # 2 ranks: each holds half of every weight, gathered for the call and its backward
        reports = run_two_ranks(WORKER, [str(ckpt), backend], tmp_path, timeout=240)
    else:
        run = subprocess.run([sys.executable, WORKER, str(ckpt), backend, str(tmp_path)], capture_output=True,
                             text=True, timeout=240, env=clean_env(OMP_NUM_THREADS="1"))
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        reports = [json.loads((tmp_path / "rank0.json").read_text())]
    for report in reports:
        # the chunk sized for the hidden states' device (4 positions here: several chunks per pass)
        assert set(report["chunk_devices"]) == {"cpu"} and report["tied"] == (arch == "qwen2")
        # both the hand-written backward: fsdp2 on the root's unsharded weight, ZeRO-3 on the gathered partition
        assert report["plain_weight"] == [True], report["plain_weight"]
        assert report["logprobs_diff"] <= 1e-6 and report["entropy_diff"] <= 1e-6, report
        assert all(report["grad_nonzero"].values()), report["grad_nonzero"]
        worst = max(report["grad_rel_diff"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, worst
