"""The GPU suite (`pytest tests/gpu`, marker `gpu`): what only a GPU shows — bf16 steps of every backend on a device,
a rollout server on the same GPU, CUDA memory figures and offload, NCCL groups, CUDA memory handed between vLLM and
training. Every test here skips without CUDA (CI has none), unless `GRPO_GPU_SUITE_ON_CPU=1` runs its logic on the
CPU; the two-GPU cases skip below two GPUs, and only the tests that need vLLM skip without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_helpers import ON_CPU


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available() and not ON_CPU:
                item.add_marker(pytest.mark.skip(reason="needs CUDA (the GPU suite)"))
