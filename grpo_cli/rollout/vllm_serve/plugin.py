"""grpo-cli's vLLM plugin (entry point group `vllm.general_plugins`, name `grpo_cli`; see pyproject.toml): registers
the `grpo_shm` weight-transfer backend (`shm_engine`) with vLLM's factory, lazily, in every vLLM process. vLLM loads
general plugins in its API server, engine core and worker processes, so the worker that builds the backend named
by `--weight-transfer-config '{"backend": "grpo_shm"}'` finds it. Loading twice in one process is harmless."""

from __future__ import annotations

ENTRY_POINT = "grpo_cli = grpo_cli.rollout.vllm_serve.plugin:register"
"""The line of the entry point (as in an `entry_points.txt` under `[vllm.general_plugins]`)."""


def register() -> None:
    """Register `grpo_shm` with `WeightTransferEngineFactory` unless it is registered already."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from grpo_cli.rollout.vllm_serve.shm_engine import BACKEND

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "grpo_cli.rollout.vllm_serve.shm_engine", "ShmWeightTransferEngine")
