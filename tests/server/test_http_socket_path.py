"""The http weight transport's socket path: the client writes the chunked body to the socket itself
(`rollout/transport/wire.py`) and the server reads it straight from the socket into the frame buffer
(`server/raw_body.py`). Chunk parsing on a real socket pair; the whole path against the app over 127.0.0.1:
weights loaded, refusals answered (before the body and after part of it) and the server usable after each."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import torch
from served_app import app_in_thread

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.remote.client import ServerEngine
from grpo_cli.rollout.transport import wire
from grpo_cli.rollout.transport.codec import FrameError, encode_stream
from grpo_cli.rollout.transport.http_client import Policy
from grpo_cli.server import raw_body
from grpo_cli.server.app import create_app

TOKEN = "s3cret-token"
FAST = Policy(connect_timeout_s=5, request_timeout_s=30, retries=1, backoff_s=0.05)


def _read_all(data: bytes, sizes: list[int]) -> tuple[bytes, raw_body.ChunkedSocket]:
    """`data` sent on one end of a socket pair, read back with `readinto` views of `sizes` (cycled)."""
    a, b = socket.socketpair()
    sender = threading.Thread(target=lambda: (a.sendall(data), a.shutdown(socket.SHUT_WR)))
    sender.start()
    reader = raw_body.ChunkedSocket(b, stage_bytes=1024)
    out, i = bytearray(), 0
    try:
        while True:
            view = memoryview(bytearray(sizes[i % len(sizes)]))
            n = reader.readinto(view)
            if n == 0:
                break
            out += view[:n]
            i += 1
    finally:
        sender.join()
        a.close()
        b.close()
    return bytes(out), reader


def test_chunked_bodies_are_read_whatever_the_chunking():
    payload = bytes(range(256)) * 1200  # 307,200 bytes
    cuts = [0, 1, 4, 3000, 3005, 250_000, len(payload)]  # chunks of 1, 3, 2996 (> the 1 KiB stage), 5, ...
    body = b"".join(b"%x%s\r\n%s\r\n" % (e - s, b";ext=1" if k == 2 else b"", payload[s:e])
                    for k, (s, e) in enumerate(zip(cuts, cuts[1:])))
    body += b"0\r\nX-Trailer: yes\r\n\r\n"
    for sizes in ([7], [100_000], [1, 65536, 3]):
        got, reader = _read_all(body, sizes)
        assert got == payload and reader.done and reader.bytes == len(payload)


@pytest.mark.parametrize("body, match", [
    (b"zz\r\nabc\r\n0\r\n\r\n", "malformed chunk size"),
    (b"-3\r\nabc\r\n0\r\n\r\n", "malformed chunk size"),
    (b"3\r\nabcdef\r\n0\r\n\r\n", "longer than its announced size"),
    (b"a\r\nabc", "closed the connection"),
    (b"1" * 5000, "too long"),
])
def test_malformed_or_cut_bodies_are_refused(body, match):
    with pytest.raises(FrameError, match=match):
        _read_all(body, [4096])


@pytest.fixture
def server(served_tiny, monkeypatch):
    taken = []
    take = raw_body.take

    def spy(scope, receive, **kw):
        taken.append(take(scope, receive, **kw))
        return taken[-1]

    monkeypatch.setattr(raw_body, "take", spy)
    with app_in_thread(create_app(served_tiny, token=TOKEN)) as url:
        yield url, served_tiny, taken


def _frames(tensors, version):
    return [p for f in encode_stream(tensors, chunk_bytes=1 << 12, version=version) for p in f]


def _post(url, pieces, version, token=TOKEN):
    return wire.post_chunked(url, "/update_weights", pieces, params={"version": version},
                             headers={"Authorization": f"Bearer {token}"}, connect_timeout=5, timeout=30)


def _info(url):
    return httpx.get(f"{url}/info", headers={"Authorization": f"Bearer {TOKEN}"}).json()


def test_socket_path_loads_the_weights_and_refusals_leave_the_server_usable(server):
    url, served, taken = server
    params = [(n, p.detach().clone() + 0.25) for n, p in served.engine.model.named_parameters()]
    eng = ServerEngine([url], policy=FAST, token=TOKEN)
    eng.update_weights(params, 3)
    assert eng.weight_version == 3 and taken[-1] is not None  # read from the socket, not through ASGI
    for (name, want), (_, got) in zip(params, served.engine.model.named_parameters(), strict=True):
        assert torch.equal(got, want), name

    sent = []

    def watched(pieces):
        for p in pieces:
            sent.append(len(p))
            yield p

    r = _post(url, watched(_frames(params, 4)), 4, token="wrong")  # refused before any body byte
    assert r.status_code == 401 and not sent

    r = _post(url, _frames(params, 9), 4)  # frames of another version: refused after the server read the body
    assert r.status_code == 400 and "frame for version 9" in r.json()["error"] and taken[-1] is not None
    assert _info(url)["state"] == "ready" and _info(url)["weight_version"] == 3

    frames = _frames(params, 5)
    r = _post(url, frames[: len(frames) // 2], 5)  # the body ends mid-stream: the update fails, nothing hangs
    assert r.status_code == 400 and "ended" in r.json()["error"]
    assert _info(url)["state"] == "inconsistent"
    eng.update_weights(params, 6)  # a complete update restores the server
    assert _info(url)["state"] == "ready" and eng.weight_version == 6
    eng.close()


def test_client_disconnecting_mid_body_fails_the_update_only(server):
    url, served, taken = server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /update_weights?version=2 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  b"Expect: 100-continue\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(b"1000\r\n" + b"\0" * 100)  # part of a chunk, then the client goes away
    eng = ServerEngine([url], policy=FAST, token=TOKEN)
    assert eng.generate([[3, 4]], SamplingParams(n=1, max_tokens=2)).weight_version == 0  # bad magic: not loaded
    assert taken and taken[-1] is not None
    eng.close()


def test_socket_path_only_where_no_proxy_or_tls_is_in_the_way(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert wire.usable("http://10.0.0.5:8000", loopback=False)
    assert not wire.usable("https://10.0.0.5:8000", loopback=False)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert not wire.usable("http://10.0.0.5:8000", loopback=False)
    assert wire.usable("http://127.0.0.1:8000", loopback=True)  # httpx ignores proxies for loopback too


def test_updates_copy_on_one_thread_and_generation_gets_its_threads_back(monkeypatch):
    from grpo_cli.server.weights import LOAD_THREADS, one_thread

    # an in-process vLLM CPU worker made earlier in this pytest process replaces torch.set_num_threads with a no-op
    # (vllm/v1/worker/cpu_worker.py, after its thread binding); a `grpo serve-rollout --engine hf` has torch's own
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    before = torch.get_num_threads()
    assert one_thread(torch.get_num_threads) == LOAD_THREADS == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ZeroDivisionError):
        one_thread(lambda: 1 / 0)
    assert torch.get_num_threads() == before
