"""The weight-sync probe is judged at the precision it was computed in: the trainer's compute dtype (bf16 under mixed
precision), not the dtype of its float32 master weights (DESIGN.md 4b)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_cli.rollout.base import RolloutEngine, RolloutError
from grpo_cli.train.weights.weight_sync import PROBE_TOLERANCE, verify_sync

PROBE = [[3, 4, 6, 7]]


class _Source:
    """A trainer with float32 masters computing in bf16 (what `model.dtype: bfloat16` gives by default)."""

    dtype = torch.float32
    compute_dtype = torch.bfloat16

    def probe_logprobs(self, probe):
        return [[-1.0] * (len(s) - 1) for s in probe]


class _Engine(RolloutEngine):
    """A float32 engine (`grpo serve-rollout --engine hf` at its default dtype) whose logprobs are off by `diff`."""

    dtype = "float32"  # as a server client reports it

    def __init__(self, diff: float) -> None:
        self.diff, self.weight_version = diff, 4

    def score(self, probe):
        return [[-1.0 + self.diff] * (len(s) - 1) for s in probe]


def test_bf16_compute_over_fp32_masters_is_judged_at_bf16_tolerance():
    """A 0.0013 nats/token probe difference (bf16 compute vs a float32 engine: the run that stopped at step 4) is
    within bf16's tolerance; it failed when the float32 master dtype chose float32's 1e-3."""
    out = verify_sync(_Engine(0.0013), _Source(), version=4, sent={}, probe=PROBE)
    assert out["sync/mean_probe_diff"] == pytest.approx(0.0013)


def test_probe_failure_names_both_dtypes_compared():
    tol = PROBE_TOLERANCE[torch.bfloat16]
    with pytest.raises(RolloutError, match="did not take: probe logprobs differ") as caught:
        verify_sync(_Engine(2 * tol), _Source(), version=4, sent={}, probe=PROBE)
    text = str(caught.value)
    assert f"tolerance {tol:g}" in text
    assert "the trainer's compute dtype bfloat16" in text and "the engine's float32" in text, text


def test_fp32_compute_keeps_the_tight_tolerance():
    source = _Source()
    source.compute_dtype = torch.float32
    with pytest.raises(RolloutError, match="tolerance 0.001"):
        verify_sync(_Engine(0.0013), source, version=4, sent={}, probe=PROBE)


def test_module_source_reports_compute_dtype_and_probes_in_it(tiny_checkpoint):
    """`TrainingBackend.weight_source()` (ddp/fsdp2/deepspeed): `dtype` is the held (master) weights', `compute_dtype`
    `model.dtype`, and the probe runs under the backend's compute context (ddp: autocast)."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.config.load import build_config
    from grpo_cli.train.backends.base import TrainingBackend

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    seen = []

    class Backend(TrainingBackend):
        def compute_context(self):
            seen.append("compute")
            return torch.autocast("cpu", dtype=torch.bfloat16)

    backend = Backend(build_config(overrides=["model.dtype=bfloat16"]), SimpleNamespace(), torch.device("cpu"))
    backend.module = model
    source = backend.weight_source()
    assert (source.dtype, source.compute_dtype) == (torch.float32, torch.bfloat16)
    under_autocast = source.probe_logprobs(PROBE)
    assert seen == ["compute"]
    from grpo_cli.train.weights.hf_module import ModuleWeights

    plain = ModuleWeights(model)  # a bare module: computes in its own dtype, no context
    assert plain.compute_dtype == torch.float32
    assert under_autocast != plain.probe_logprobs(PROBE)  # bf16 compute gives other numbers


def test_megatron_source_compute_dtype_is_model_dtype():
    from grpo_cli.config.load import build_config
    from grpo_cli.train.backends.megatron.weights import MegatronWeights

    backend = SimpleNamespace(cfg=build_config(overrides=["model.dtype=bfloat16"]),
                              model=torch.nn.Linear(2, 2), batch_logprobs=None)
    source = MegatronWeights(backend)
    assert source.compute_dtype == torch.bfloat16
