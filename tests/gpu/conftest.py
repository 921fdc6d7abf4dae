"""The GPU suite (`pytest tests/gpu`, marker `gpu`): what only a GPU shows — NCCL groups, CUDA memory handed between
vLLM and training, bf16 sharded steps on a device. Every test here skips without CUDA (CI has none); the two-GPU
cases skip below two GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs CUDA (the GPU suite)"))
