"""What keeps the http weight transport fast on loopback: the client hands httpx views of at most SEND_BYTES (no
copy), the server reads the body ahead of the engine's thread up to its limit (and drops it after a failure), and
frame buffers are reused once no tensor views them."""

from __future__ import annotations

import threading

import anyio
import torch

from grpo_cli.rollout.transport.codec import ReceiveBuffer, encode_frame
from grpo_cli.rollout.transport.wire import SEND_BYTES, sliced
from grpo_cli.server.upload import StreamedBody


def test_the_body_goes_out_in_bounded_views_of_the_tensors():
    big = torch.arange(3 * SEND_BYTES // 4 + 5, dtype=torch.float32)
    frame = encode_frame([("big", big), ("small", torch.ones(3))], {"grpo_frame": "data"})
    views = list(sliced(frame))
    assert all(isinstance(v, memoryview) and len(v) <= SEND_BYTES for v in views)
    assert b"".join(views) == b"".join(bytes(p) for p in frame)
    assert any(v.obj is frame[2].obj for v in views)  # views of the tensor's own bytes, not copies


def test_the_body_is_read_ahead_of_the_consumer_up_to_its_limit_then_dropped_after_discard():
    chunks = [bytes([i]) * 100 for i in range(50)]
    read = []

    async def stream():
        for c in chunks:
            read.append(len(c))
            yield c

    body = StreamedBody(stream(), limit=1000)
    got: list[bytes] = []
    taken = threading.Event()

    def consume():
        it = body.chunks()
        got.extend(next(it) for _ in range(20))
        taken.set()
        body.discard()  # the update failed: the rest is read and dropped
        got.extend(it)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(body.fill)
            await anyio.sleep(0.3)  # nothing consumed yet: read ahead to about the limit, then wait
            assert 10 <= len(read) <= 12
            await anyio.to_thread.run_sync(consume)

    anyio.run(main)
    assert len(read) == 50 and got[:20] == chunks[:20] and sum(map(len, got)) <= 100 * 32


def test_frame_buffers_are_reused_once_no_tensor_views_them():
    buffers = ReceiveBuffer()
    first = buffers.take(100)
    held = torch.frombuffer(first, dtype=torch.uint8)
    owner = id(first.obj)  # an id: a reference here would keep the buffer busy
    del first
    second = buffers.take(100)
    assert id(second.obj) != owner  # the first is still viewed by a tensor
    del second
    del held
    assert id(buffers.take(80).obj) == owner  # free again: reused, no new allocation (both are still held)
