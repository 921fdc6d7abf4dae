"""ZeRO-1 + bf16 + fp32 gradient accumulation makes DeepSpeed step through its BF16_Optimizer, which cannot move its
state (`offload_states`): `distributed.offload` is refused there, and only there, by the config rules (issue 36)."""

from __future__ import annotations

import itertools

import pytest
import torch
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.planner.deepspeed import deepspeed_config
from grpo_cli.config.load import ConfigError, build_config

ZERO1_BF16 = ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=1", "model.dtype=bfloat16"]


def test_the_cli_refuses_zero1_bf16_with_offload():
    result = CliRunner().invoke(app, ["train", *(a for o in [*ZERO1_BF16, "distributed.offload.optimizer=true"]
                                                 for a in ("--set", o)), "--dry-run"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "BF16_Optimizer" in text and "distributed.deepspeed.zero_stage=2" in text and "model.dtype=float32" in text


def _deepspeed_choice(ds_json: dict, monkeypatch) -> str | None:
    """The optimizer wrapper DeepSpeed 0.19.8 picks for `ds_json`: its own `_do_optimizer_sanity_check`, run on an
    object that has only the engine methods that choice reads (no model, no process group; torch AdamW is "untested"
    by ZeRO, which our JSON allows, and only its warning would ask for the process group's rank)."""
    from deepspeed.runtime import engine
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setattr(engine, "is_zero_supported_optimizer", lambda _optimizer: False)

    class Choice:
        global_rank, pipeline_parallelism = 0, False

        def __init__(self):
            self._config = DeepSpeedConfig(ds_json)

    for name in ("get_data_types", "fp16_enabled", "bfloat16_enabled", "zero_optimization", "zero_optimization_stage",
                 "zero_cpu_offload", "zero_allow_untested_optimizer", "zero_compute_grad_norm",
                 "_do_optimizer_sanity_check"):
        setattr(Choice, name, getattr(DeepSpeedEngine, name))
    return Choice()._do_optimizer_sanity_check(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))


def test_the_rule_refuses_exactly_where_deepspeed_picks_bf16_optimizer(monkeypatch):
    from deepspeed.runtime.engine import BFLOAT16

    seen = set()
    for stage, dtype, reduce, host_adam in itertools.product((1, 2, 3), ("float32", "bfloat16", "float16"),
                                                             ("float32", "bfloat16"), (False, True)):
        base = ["distributed.backend=deepspeed", f"distributed.deepspeed.zero_stage={stage}", f"model.dtype={dtype}",
                f"distributed.reduce_dtype={reduce}", f"distributed.deepspeed.offload_optimizer={host_adam}",
                "rollout.engine=vllm"]
        choice = _deepspeed_choice(deepspeed_config(build_config(overrides=base)), monkeypatch)
        seen.add(choice)
        try:
            build_config(overrides=[*base, "distributed.offload.grads=true"])
            refused = False
        except ConfigError as exc:
            assert "BF16_Optimizer" in str(exc), str(exc)
            refused = True
        assert refused == (choice == BFLOAT16), (base, choice)
    assert BFLOAT16 in seen  # the combination exists, so the comparison above covered both outcomes


def test_bf16_optimizer_has_no_offload_states():
    """The crash the rule prevents: `engine.offload_states` calls `self.optimizer.offload_states`, which the ZeRO
    optimizers have and BF16_Optimizer lacks."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert not hasattr(BF16_Optimizer, "offload_states") and hasattr(DeepSpeedZeroOptimizer, "offload_states")


@pytest.mark.parametrize("overrides", [
    [*ZERO1_BF16],  # no offload: BF16_Optimizer is fine
    [*ZERO1_BF16, "distributed.offload.optimizer=true", "distributed.reduce_dtype=bfloat16"],  # ZeRO's own optimizer
    ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=2", "model.dtype=bfloat16",
     "distributed.offload.optimizer=true"],
])
def test_accepted(overrides):
    build_config(overrides=overrides)
