"""The `nccl` weight transport on CPU: the same code path, its group built over gloo (`nccl._group` picks gloo off
CUDA), the trainer and a real `serve-rollout` app (uvicorn on a thread) as the two ranks of one process. Only
`nccl_available` is patched (it keeps users to CUDA). Bucket by bucket on both sides, a version committed by the last
bucket, and a server that stops answering mid-sync surfacing as RolloutServerDown within the HTTP timeout."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
from dist_env import free_port
from served_app import app_in_thread

from grpo_cli.config.load import build_config
from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.rollout.remote.client import ServerEngine
from grpo_cli.rollout.transport import nccl
from grpo_cli.server.app import create_app
from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown

TOKEN = "nccl-token"
CHUNK = 64 << 10  # the tiny model's 355 KiB in ~7 buckets


@pytest.fixture
def nccl_server(served_tiny, monkeypatch):
    monkeypatch.setattr(nccl, "nccl_available", lambda: (True, ""))
    monkeypatch.setattr(nccl, "GROUP_GRACE_S", 5.0)
    with app_in_thread(create_app(served_tiny, token=TOKEN)) as url:
        yield url, served_tiny


def _client(url: str, timeout_s: float = 30.0) -> ServerEngine:
    eng = ServerEngine([url], policy=Policy(connect_timeout_s=10, request_timeout_s=timeout_s, retries=0),
                       token=TOKEN, transport="nccl")
    eng.chunk_bytes = CHUNK
    return eng


def _changed(served) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [(n, p.detach().clone() + 0.01 * torch.randn_like(p)) for n, p in served.engine.model.named_parameters()]


def test_nccl_streams_bucket_by_bucket_and_the_server_loads_each_before_the_next(nccl_server, monkeypatch):
    url, served = nccl_server
    params = _changed(served)
    log: list[tuple] = []
    pulled = [0]

    def stream():  # what the trainer's weight stream hands over, one tensor at a time
        for item in params:
            pulled[0] += 1
            yield item

    receive = nccl.NcclReceiver.receive

    def logged_receive(self, names, dtypes, shapes):
        log.append(("receive", list(names), pulled[0]))
        return receive(self, names, dtypes, shapes)

    monkeypatch.setattr(nccl.NcclReceiver, "receive", logged_receive)
    load = served.engine.update_weights

    def logged_load(tensors, version):
        def each():
            for name, t in tensors:
                log.append(("load", name))
                yield name, t
        return load(each(), version)

    monkeypatch.setattr(served.engine, "update_weights", logged_load)
    eng = _client(url)
    eng.update_weights(stream(), 3)

    buckets = [entry for entry in log if entry[0] == "receive"]
    assert len(buckets) > 1 and [n for b in buckets for n in b[1]] == [n for n, _ in params]
    sizes = dict((n, t.nbytes) for n, t in params)
    assert all(sum(sizes[n] for n in b[1]) <= CHUNK or len(b[1]) == 1 for b in buckets)
    assert eng._nccl.last_buckets == [sum(sizes[n] for n in b[1]) for b in buckets]
    sent = 0
    for k, (_, names, pulled_then) in enumerate(buckets):
        at = log.index(buckets[k])
        loaded = [e[1] for e in log[:at] if e[0] == "load"]
        assert loaded == [n for n, _ in params][:sent]  # every earlier bucket loaded before this one is received
        sent += len(names)
        assert pulled_then <= sent + 1  # the trainer holds this bucket and at most the next tensor
    model = dict(served.engine.model.named_parameters())
    assert all(torch.equal(model[n], t) for n, t in params)
    assert eng.weight_version == 3 and eng.last_sync["bytes"] == sum(sizes.values())
    assert eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2, seed=1)).weight_version == 3
    eng.close()


def test_a_bucket_stream_left_unfinished_refuses_generation_until_a_complete_update(nccl_server):
    url, served = nccl_server
    params = _changed(served)
    eng = _client(url)
    eng.update_weights(params, 1)
    sender = eng._nccl
    first = [(n, t.clone()) for n, t in params[:2]]
    assert sender._send_bucket(first, 0, False, 2)[0]["bucket"] == 0  # the trainer stops after one bucket
    with pytest.raises(RolloutError, match="409: an NCCL weight update to v2 is in progress"):
        eng.generate([[3, 4]], SamplingParams(n=1, max_tokens=2))
    eng.update_weights(params, 2)  # a new update ends the unfinished one and completes
    assert eng.generate([[3, 4]], SamplingParams(n=1, max_tokens=2)).weight_version == 2
    eng.close()


class _NcclLikeWork:
    """A work whose wait returns True on the host at once, as a NCCL work's does (it only orders the CUDA stream)."""

    def __init__(self, work) -> None:
        self.work = work

    def wait(self, *_a, **_k) -> bool:
        return True


class _NcclLikeGroup:
    def __init__(self, pg) -> None:
        self.pg = pg

    def broadcast(self, tensor, root, *a):
        return _NcclLikeWork(self.pg.broadcast(tensor, root, *a))

    def abort(self) -> None:
        self.pg.abort()


def test_a_server_that_stops_answering_mid_sync_raises_server_down_within_the_timeout(nccl_server, monkeypatch):
    url, served = nccl_server
    group = nccl._group
    monkeypatch.setattr(nccl, "_group", lambda *a: _NcclLikeGroup(group(*a)) if a[3] == 0 else group(*a))
    receive = nccl.NcclReceiver.receive
    calls, release = [0], threading.Event()

    def stalling_receive(self, names, dtypes, shapes):
        calls[0] += 1
        if calls[0] == 2:  # alive but silent from the second bucket on
            release.wait(30)
            receive(self, names, dtypes, shapes)  # take the pending broadcasts so gloo has nothing left behind
            raise RuntimeError("released by the test")
        return receive(self, names, dtypes, shapes)

    monkeypatch.setattr(nccl.NcclReceiver, "receive", stalling_receive)
    eng = _client(url, timeout_s=2.0)
    start = time.monotonic()
    try:
        with pytest.raises(RolloutServerDown) as err:
            eng.update_weights(_changed(served), 1)
        assert time.monotonic() - start < 2.0 + 3.0
        assert "stopped answering during /update_weights_nccl" in str(err.value) and not err.value.recovered
        assert eng._nccl is None  # the next update joins the server again
    finally:
        release.set()
        eng.close()


def test_on_cuda_the_transport_is_this_gpu_over_nccl_with_the_group_timeout(monkeypatch):
    """The CUDA branches, driven on CPU: the current GPU is the transport device, and the group is NCCL's with the
    timeout the trainer's HTTP wait relies on, built so that a timeout raises instead of taking the process down
    (issue 46, 4.7: torch's default error handling, 3, tears the process down; 2 aborts the communicators and fails
    the work). torch's NCCL classes and CUDA queries are replaced by recorders."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # what a launcher may have set for the training group
    assert nccl.transport_device() == torch.device("cuda", 3)
    made = []

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, world, opts):
            made.append((rank, world, opts._timeout, os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))

    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", FakeNCCL, raising=False)
    port = free_port()
    nccl._group("127.0.0.1", port, 1, 0, 7.0, torch.device("cuda", 3))
    assert made == [(0, 1, timedelta(seconds=7.0), "2")]  # 2: CleanUpOnly, the collective raises
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # other groups keep the process's setting


@pytest.mark.parametrize("on_failure", ["stop", "wait"])
def test_the_group_timeout_exceeds_the_longest_the_http_wait_can_take(on_failure, monkeypatch):
    """Issue 46 (4.7): under `on_failure: wait` (600 s per request, 300 s recovery) the group timed out after 660 s
    while the trainer could still be waiting for a server's answer, and the watchdog ended the trainer before its
    checkpoint. The timeout `connect` gives both ends exceeds every retry, wait and recovery of the HTTP path."""
    server = build_config(overrides=[f"rollout.server.on_failure={on_failure}"]).rollout.server
    policy = Policy.of(server)
    worst = (min(10.0, server.connect_timeout_s) + server.request_timeout_s) * 1 + (
        server.wait_for_recovery_s + 7.0 + 10.0 + server.request_timeout_s if on_failure == "wait" else 0.0)
    assert policy.worst_case_s(idempotent=False) == worst  # 610 s (stop), 1527 s (wait) at the defaults
    assert nccl.answer_wait_s(policy) > worst
    assert nccl.group_timeout_s(policy) > nccl.answer_wait_s(policy) + 30.0
    monkeypatch.setattr(nccl, "nccl_available", lambda: (True, ""))
    built, asked = [], []
    monkeypatch.setattr(nccl, "_group", lambda host, port, world, rank, timeout_s, device: built.append(timeout_s))
    monkeypatch.setattr(nccl, "_handshake", lambda pg, device: None)

    class Http:
        def __init__(self):
            self.policy = policy

        def call(self, url, method, path, **kw):
            asked.append(kw["json"]["timeout_s"])

    nccl.NcclSender.connect(Http(), ["http://127.0.0.1:1"], timeout_s=server.request_timeout_s).close()
    assert built == asked == [nccl.group_timeout_s(policy)]  # the trainer's end and the server's
    if on_failure == "wait":
        assert built[0] > 1527.0 > 660.0
