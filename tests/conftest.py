"""Shared fixtures: the tiny checkpoint (built locally, fp32, head_dim 32) and an isolated cache dir."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A random-init 2-layer Llama + word-level tokenizer saved like a real checkpoint."""
    from grpo_cli.train.tiny_model import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Keep `builtin:tiny` builds out of the user's ~/.cache during tests."""
    os.environ.setdefault("GRPO_CLI_CACHE", str(tmp_path_factory.mktemp("grpo-cache")))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield
