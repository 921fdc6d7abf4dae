"""`grpo serve-rollout --tensor-parallel-size N`: SGLang's to take; hf and vllm serve one device per server (the vLLM
engine runs in the server's process, its weight reloads cannot reach the workers of vLLM's multi-process executor).
The refusal comes first (exit 2, before vLLM is imported or a port bound), and no advice, the CLI's or the async
rule's, points at a command that is refused."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.server.engines import ServeError, ServeOptions, check_options


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_tensor_parallel_hf_or_vllm_server_is_refused_up_front_with_exit_2(engine, tiny_checkpoint, monkeypatch):
    import grpo_cli.server.launch as launch

    monkeypatch.setattr(launch, "bind", lambda *a: pytest.fail("a port was bound before the refusal"))
    result = CliRunner().invoke(app, ["serve-rollout", "--engine", engine, "--model", tiny_checkpoint,
                                      "--tensor-parallel-size", "2", "--port", "0"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"--engine {engine}" in text and "--engine sglang" in text
    if engine == "vllm":
        assert "rollout.server.urls" in text  # the other way out: one server per GPU


def test_every_serve_rollout_command_the_advice_gives_is_accepted():
    """The refusal's and the async rule's suggestions pass the same check (the async rule used to send users to
    `grpo serve-rollout --tensor-parallel-size N`, which --engine vllm refuses)."""
    from grpo_cli.config.load import ConfigError, build_config

    with pytest.raises(ServeError) as refused:
        check_options(ServeOptions(engine="vllm", model="/m", tensor_parallel_size=4))
    with pytest.raises(ConfigError) as rule:
        build_config("qwen-7b-async", overrides=["rollout.vllm.tensor_parallel_size=2", "distributed.rollout_gpus=8"])
    for advice in (str(refused.value), str(rule.value)):
        commands = re.findall(r"`(grpo serve-rollout[^`]*)`", advice)
        assert commands, advice
        for cmd in commands:
            args = cmd.split()
            engine = args[args.index("--engine") + 1] if "--engine" in args else "hf"
            tp = args[args.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in args else "1"
            check_options(ServeOptions(engine=engine, model="/m", tensor_parallel_size=4 if tp == "N" else int(tp)))
