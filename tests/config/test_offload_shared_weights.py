"""The colocated hf engine generates with the policy's own parameters: `distributed.offload.params` would move them
to the host right before generation (which then ran on the CPU, silently), so the config rules refuse it on every
device (issue 36)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import ConfigError, build_config

PARAMS = "distributed.offload.params=true"


def test_the_cli_refuses_offloading_the_parameters_the_hf_engine_generates_with():
    result = CliRunner().invoke(app, ["train", "--set", "rollout.engine=hf", "--set", PARAMS, "--dry-run"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "distributed.offload.params" in text and "rollout.engine 'hf'" in text
    assert "distributed.offload.params=false" in text and "rollout.engine=vllm" in text


@pytest.mark.parametrize("extra", [[], ["distributed.device=cpu"], ["distributed.device=cuda"],
                                   ["model.dtype=bfloat16", "rollout.dtype=float32"]])
def test_refused_wherever_the_engine_shares_the_weights(extra):
    """Default float32 masters: an engine dtype of `auto` or float32 shares them, on any device."""
    with pytest.raises(ConfigError, match=r"distributed\.offload\.params .* rollout\.engine 'hf'"):
        build_config(overrides=[PARAMS, *extra])


@pytest.mark.parametrize("overrides", [
    [PARAMS, "rollout.engine=vllm"],  # vLLM holds its own copy
    [PARAMS, "model.dtype=bfloat16", "rollout.dtype=bfloat16"],  # the hf engine's own bf16 copy of float32 masters
    ["distributed.offload.optimizer=true", "distributed.offload.grads=true"],  # generation needs only the weights
])
def test_accepted(overrides):
    build_config(overrides=overrides)
