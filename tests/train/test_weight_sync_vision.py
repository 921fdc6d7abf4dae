"""Weight sync of a vision-language model (the built-in tiny Qwen2-VL) into the rollout server's hf engine (built as
`grpo serve-rollout --engine hf` builds it, in this process): the vision tower goes under its Hugging Face names
(`model.visual.*`), and with `skip` (`model.freeze_vision` after the first sync) it is not sent at all: the engine
keeps its own copy even where the trainer's differs, and the metrics count only what was sent."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.models.vision import causal_lm_class, is_vision_parameter
from grpo_cli.train.weights.weight_sync import sync_weights


@pytest.fixture(scope="module")
def vlm_path():
    from grpo_cli.models.tiny import resolve_model_path

    return resolve_model_path("builtin:tiny-vlm")


def _policy(path):
    from transformers import AutoConfig

    return causal_lm_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)


def test_a_frozen_vision_tower_is_sent_once_then_skipped(vlm_path):
    from grpo_cli.server.engines import ServeOptions, build

    engine = build(ServeOptions(engine="hf", model=vlm_path)).engine
    policy = _policy(vlm_path)
    params = dict(policy.named_parameters())
    vision = sorted(n for n in params if is_vision_parameter(n))
    assert vision and all(n.startswith("model.visual.") for n in vision)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    first = sync_weights(engine, policy, version=1, bucket_mb=1, verify=False, probe=None)
    held = dict(engine.model.named_parameters())
    assert all(torch.equal(held[n], params[n]) for n in params)  # every weight, the vision tower's too
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)  # the vision tower too: were it sent, the engine would hold it
    second = sync_weights(engine, policy, version=2, bucket_mb=1, verify=False, probe=None, skip=is_vision_parameter)
    for n in params:
        assert torch.equal(held[n], params[n]) != is_vision_parameter(n), n
    sizes = {n: p.numel() * 4 / 2**20 for n, p in params.items()}
    tied = 1  # lm_head.weight: the tied embedding sent under its second name too
    assert first["sync/tensors"] == len(params) + tied and "sync/skipped_tensors" not in first
    assert second["sync/tensors"] == len(params) + tied - len(vision) and second["sync/skipped_tensors"] == len(vision)
    assert second["sync/megabytes"] == pytest.approx(first["sync/megabytes"] - sum(sizes[n] for n in vision))
