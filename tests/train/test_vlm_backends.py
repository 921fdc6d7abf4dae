"""The built-in tiny VLM on the sharding backends, 2 real gloo processes each (`vlm_backends_worker.py`): one
optimizer step on image prompts trains the language model, leaves the frozen vision tower bit-identical (gathered
from shards/partitions), fsdp2 makes every vision block its own FSDP2 unit like the decoder layers, and the weight
sync streams the vision tower under its Hugging Face names (`model.visual.*`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_env import run_two_ranks

WORKER = str(Path(__file__).with_name("vlm_backends_worker.py"))


@pytest.mark.parametrize("backend", ["fsdp2", "zero2", "zero3"])
def test_a_vlm_trains_on_the_sharding_backends_with_its_vision_tower_frozen(backend, tmp_path):
    ranks = run_two_ranks(WORKER, [backend], tmp_path, timeout=240)
    for r in ranks:
        assert r["vision_change"] == 0.0 and r["trainable_vision"] == 0, r
        assert r["language_change"] > 1e-4, r
        assert any(n.startswith("model.visual.blocks.1.") for n in r["names"])
        assert any(n.startswith("model.language_model.layers.1.") for n in r["names"])
        if backend == "fsdp2":
            assert r["units"]["Qwen2VLVisionBlock"] == [True, True], r["units"]
            assert r["units"]["Qwen2VLDecoderLayer"] == [True, True], r["units"]
    assert ranks[0]["names"] == ranks[1]["names"]
