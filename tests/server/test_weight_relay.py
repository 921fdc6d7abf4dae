"""Weight fan-out by relay (`rollout.server.weight_fanout: relay`, http transport): the trainer uploads once to the
first server, each server forwards the stream to the next as it reads it and checks every frame itself."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from served_app import app_in_thread

from grpo_cli.rollout.remote.client import ServerEngine
from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown
from grpo_cli.server.app import create_app
from grpo_cli.server.engines import ServeOptions, build

TOKEN = "relay-token"
FAST = Policy(connect_timeout_s=30, request_timeout_s=60, retries=0)


def test_a_relay_of_three_servers_delivers_the_same_verified_weights(tiny_checkpoint):
    served = [build(ServeOptions(engine="hf", model=tiny_checkpoint)) for _ in range(3)]
    with ExitStack() as stack:
        urls = [stack.enter_context(app_in_thread(create_app(s, token=TOKEN))) for s in served]
        engine = ServerEngine(urls, policy=FAST, token=TOKEN, chunk_mb=1)
        uploads, real_upload = [], engine.http.upload
        engine.http.upload = lambda url, *a, **kw: uploads.append(url) or real_upload(url, *a, **kw)
        sent_bytes = []
        try:
            for version, shift in ((1, 0.25), (2, -0.5)):
                tensors = [(n, p.detach().clone() + shift) for n, p in served[0].engine.model.named_parameters()]
                engine.update_weights(iter(tensors), version)
                sent_bytes.append(engine.last_sync["bytes"])
                for s in served:
                    assert s.engine.weight_version == version
                    for (n, want), (_, got) in zip(tensors, s.engine.model.named_parameters(), strict=True):
                        assert torch.equal(want, got), n
        finally:
            engine.close()
    # each byte left the trainer once: one upload per sync, to the head of the chain
    assert uploads == [urls[0], urls[0]] and sent_bytes[0] == sum(t.nbytes for _, t in tensors)


def test_a_server_dying_mid_relay_fails_the_sync_naming_it_and_the_next_sync_recovers(server_process, tiny_checkpoint):
    servers = [server_process(token=TOKEN) for _ in range(3)]
    urls = [s.url for s in servers]
    engine = ServerEngine(urls, policy=FAST, token=TOKEN, chunk_mb=1)
    model = build(ServeOptions(engine="hf", model=tiny_checkpoint)).engine.model
    tensors = [(n, p.detach().clone() + 0.5) for n, p in model.named_parameters()]

    def killing_after_the_first():
        yield tensors[0]
        servers[1].kill()  # the middle of the chain dies while the stream flows through it
        yield from tensors[1:]

    try:
        with pytest.raises(RolloutServerDown, match="relayed weight update") as failed:
            engine.update_weights(killing_after_the_first(), 1)
        assert failed.value.url == urls[1]
        port = int(urls[1].rsplit(":", 1)[1])
        servers[1] = server_process(token=TOKEN, port=port)
        engine.update_weights(iter(tensors), 2)  # every server checks its frames and answers v2
        assert engine.weight_version == 2
        for url in urls:
            assert engine.http.call(url, "GET", "/info").json()["weight_version"] == 2
    finally:
        engine.close()
