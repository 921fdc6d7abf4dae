"""`rollout.custom` is refused on a colocated vLLM engine at tensor parallel > 1 (a user function may call the
engine a different number of times on each rank of the group, whose every call is collective); `agent:` is not
(its turns are agreed over the group)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import build_config

CUSTOM = f"rollout.custom={Path(__file__).parents[1] / 'agent' / 'tools_for_tests.py'}:sample_then_note"


def test_a_custom_rollout_at_tensor_parallel_2_is_refused_with_exit_2():
    result = CliRunner().invoke(app, ["train", "--preset", "qwen-7b-colocate-tp2", "--dry-run", "--set", CUSTOM])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "rollout.custom" in text and "rollout.vllm.tensor_parallel_size=2" in text and "Traceback" not in text


@pytest.mark.parametrize("overrides", [
    [CUSTOM, "rollout.vllm.tensor_parallel_size=1"],
    ["agent.tools=[calculator]"],
])
def test_a_custom_rollout_at_tp_1_and_an_agent_at_tp_2_are_accepted(overrides):
    cfg = build_config("qwen-7b-colocate-tp2", overrides=overrides)
    assert cfg.rollout.custom or cfg.rollout.vllm.tensor_parallel_size == 2

