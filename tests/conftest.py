"""Shared fixtures: the tiny checkpoint (built locally, fp32, head_dim 32) and an isolated cache dir."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A random-init 2-layer Llama + word-level tokenizer saved like a real checkpoint."""
    from grpo_cli.models.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


@pytest.fixture(scope="session")
def tiny_vlm() -> str:
    """The built-in tiny Qwen2-VL (`builtin:tiny-vlm`), built once into the tests' cache."""
    from grpo_cli.models.tiny import resolve_model_path

    return resolve_model_path("builtin:tiny-vlm")


@pytest.fixture(scope="session", params=["builtin:tiny-vlm", "builtin:tiny-vlm-qwen2.5"],
                ids=["qwen2_vl", "qwen2_5_vl"])
def any_vlm(request) -> str:
    """Each tiny VLM architecture in turn: Qwen2-VL (`builtin:tiny-vlm`) and Qwen2.5-VL
    (`builtin:tiny-vlm-qwen2.5`: window attention, RMSNorm, gated MLP in the vision tower), built once each."""
    from grpo_cli.models.tiny import resolve_model_path

    return resolve_model_path(request.param)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Keep `builtin:tiny` builds out of the user's ~/.cache during tests."""
    os.environ.setdefault("GRPO_CLI_CACHE", str(tmp_path_factory.mktemp("grpo-cache")))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_launch_env():
    """Put the process-group variables back after each test: an in-process DeepSpeed/vLLM engine sets them
    (`LOCAL_RANK=0`), and a later in-process run would then make accelerate's `PartialState` (opened by a
    tracker) start a process group of its own."""
    before = {k: os.environ.get(k) for k in _DIST_VARS}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group for the test (an existing 1-rank default group is used as it is)."""
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of several ranks is already open in this process")
    yield
    if made:
        dist.destroy_process_group()
