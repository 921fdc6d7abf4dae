"""Settings of the sharded backends are refused where they would change nothing (no facades)."""

from __future__ import annotations

import pytest

from grpo_cli.config.load import ConfigError, build_config

FSDP2 = ["distributed.backend=fsdp2", "rollout.engine=vllm"]


@pytest.mark.parametrize(("overrides", "match"), [
    (["distributed.fsdp2.cpu_offload=true"], "distributed.fsdp2 settings apply only"),
    (["distributed.fsdp2.unsharded_grad_accumulation=true"], "distributed.fsdp2 settings apply only"),
    (["distributed.reduce_dtype=bfloat16"], "distributed.reduce_dtype 'bfloat16'"),
    ([*FSDP2, "distributed.fsdp2.cpu_offload=true", "distributed.offload.optimizer=true"], "has nothing to move"),
])
def test_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=overrides)


@pytest.mark.parametrize("overrides", [
    [*FSDP2, "distributed.fsdp2.cpu_offload=true", "distributed.reduce_dtype=bfloat16"],
    [*FSDP2, "distributed.fsdp2.unsharded_grad_accumulation=true"],
    ["distributed.backend=deepspeed", "distributed.reduce_dtype=bfloat16"],
    ["distributed.timeout_minutes=5"],
])
def test_accepted(overrides):
    build_config(overrides=overrides)


def test_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="timeout_minutes"):
        build_config(overrides=["distributed.timeout_minutes=0"])
