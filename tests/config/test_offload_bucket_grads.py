"""Across processes ddp's gradients are views into DistributedDataParallel's all-reduce buckets (issue 36, item
14), which DDP keeps allocated for the whole run: `distributed.offload.grads` would park a copy and free nothing, so
the rules refuse it there, and only there."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import ConfigError, build_config

GRADS = ["rollout.engine=vllm", "distributed.offload.grads=true"]


def test_the_cli_refuses_gradient_offload_under_multi_process_ddp():
    args = [a for s in [*GRADS, "distributed.num_processes=2"] for a in ("--set", s)]
    result = CliRunner().invoke(app, ["train", *args, "--dry-run"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "distributed.offload.grads" in text and "all-reduce buckets" in text
    assert "distributed.offload.grads=false" in text


def test_refused_across_machines_too():
    with pytest.raises(ConfigError, match="distributed.offload.grads frees no device memory"):
        build_config(overrides=[*GRADS, "distributed.num_machines=2", "distributed.main_process_ip=10.0.0.1"])


@pytest.mark.parametrize("extra", [
    [],  # one process: no DistributedDataParallel, the gradients own their storage
    ["distributed.num_processes=2", "distributed.backend=fsdp2"],  # gradient shards move
    ["distributed.num_processes=2", "distributed.offload.grads=false", "distributed.offload.optimizer=true"],
])
def test_accepted(extra):
    build_config(overrides=[*GRADS, *extra])
