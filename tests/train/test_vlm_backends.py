"""The built-in tiny VLM on the sharding backends, one launch of 2 real gloo processes (`vlm_backends_worker.py`): one
optimizer step on image prompts trains the language model, leaves the frozen vision tower bit-identical (gathered
from shards/partitions), fsdp2 makes every vision block its own FSDP2 unit like the decoder layers, and the weight
sync streams the vision tower under its Hugging Face names (`model.visual.*`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks

WORKER = str(Path(__file__).with_name("vlm_backends_worker.py"))


@pytest.mark.slow  # 58 s with the machine at load 9 on 2 cores: one 2-process launch, three backends
def test_a_vlm_trains_on_the_sharding_backends_with_its_vision_tower_frozen(tmp_path):
    ranks = run_two_ranks(WORKER, [], tmp_path, timeout=300)
    for backend in ("fsdp2", "zero2", "zero3"):
        for r in (rank[backend] for rank in ranks):
            assert r["vision_change"] == 0.0 and r["trainable_vision"] == 0, (backend, r)
            assert r["language_change"] > 1e-4, (backend, r)
            assert any(n.startswith("model.visual.blocks.1.") for n in r["names"])
            assert any(n.startswith("model.language_model.layers.1.") for n in r["names"])
        assert ranks[0][backend]["names"] == ranks[1][backend]["names"]
    for r in ranks:
        assert r["fsdp2"]["units"] == {"Qwen2VLVisionBlock": [True, True], "Qwen2VLDecoderLayer": [True, True]}
