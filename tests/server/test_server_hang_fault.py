"""`GRPO_INJECT_FAULT=server_hang:step=S` on a real `grpo serve-rollout` process: it says so loudly at start, answers
until it holds the weights pushed after step S-1, then answers nothing (the rollout of step S, /health included), so
the client's timeout and `rollout.server.on_failure` run as with a hung engine."""

from __future__ import annotations

import httpx
import pytest

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.remote.client import ServerEngine
from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown


def test_server_stops_answering_from_the_rollout_of_the_named_step(server_process, monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("GRPO_INJECT_FAULT", "server_hang:step=2")
    srv = server_process()
    assert "FAULT INJECTION" in "".join(srv.lines) and "server_hang:step=2" in "".join(srv.lines)
    eng = ServerEngine([srv.url], policy=Policy(connect_timeout_s=20, request_timeout_s=3, retries=0))
    assert eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2)).weight_version == 0  # step 1's rollout
    eng.update_weights_from_disk(tiny_checkpoint, 1)  # the push after step 1 is answered
    with pytest.raises(RolloutServerDown, match="stopped answering during /generate"):
        eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2))
    with pytest.raises(httpx.TimeoutException):
        httpx.get(f"{srv.url}/health", timeout=2.0)
    eng.close()


def test_sglang_refuses_server_hang(monkeypatch, tiny_checkpoint):
    from grpo_cli.server.engines import ServeError, ServeOptions
    from grpo_cli.server.launch import run_server

    monkeypatch.setenv("GRPO_INJECT_FAULT", "server_hang:step=1")
    with pytest.raises(ServeError, match="server_hang is injected by grpo serve-rollout's own app"):
        run_server(ServeOptions(engine="sglang", model=tiny_checkpoint))
