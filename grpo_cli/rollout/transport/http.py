"""`http` weight transport: the frames of `codec.encode_stream` streamed as one chunked POST `/update_weights` per
server, all servers at once from one encoding (a bounded queue per upload), so the trainer holds about one frame.

The body is handed to httpx in slices of `SEND_BYTES`, views of the tensors (no copy of ours): httpcore writes a
buffer with `while buffer: buffer = buffer[sock.send(buffer):]`, which copies what is left of a `bytes` buffer after
every partial send, so a whole 100 MB tensor handed over at once was copied dozens of times (loopback, 403 MB: 71-78
MB/s for whole pieces against 230-330 with slices of 256 KiB-4 MiB, a drain-only server on a loaded machine)."""

from __future__ import annotations

import queue
from collections.abc import Iterator

from grpo_cli.rollout.transport import codec
from grpo_cli.rollout.transport.base import NamedTensors, WeightTransport

_END = object()
SEND_BYTES = 256 << 10
"""Largest piece of the body handed to httpx at once (see the module docstring)."""


def sliced(frame: list) -> Iterator[memoryview]:
    """A frame's pieces as views of at most SEND_BYTES each."""
    for piece in frame:
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), SEND_BYTES):
            yield view[start : start + SEND_BYTES]


class HttpTransport(WeightTransport):
    name = "http"

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        urls, pool = self.link.urls, self.link.pool
        queues = [queue.Queue(maxsize=2) for _ in urls]
        futures = [pool.submit(self._upload, url, q, version) for url, q in zip(urls, queues, strict=True)]
        try:
            for frame in codec.encode_stream(named_tensors, chunk_bytes=chunk_bytes, version=version):
                for q in queues:
                    q.put(frame)  # never blocks for long: each upload drains its queue to the end, even failing
        finally:
            for q in queues:
                q.put(_END)
        return [f.result() for f in futures]

    def _upload(self, url: str, q: queue.Queue, version: int) -> dict:
        finished = False

        def body() -> Iterator[bytes]:
            nonlocal finished
            while (frame := q.get()) is not _END:
                yield from sliced(frame)
            finished = True

        try:
            return self.link.http.call(url, "POST", "/update_weights", idempotent=False, content=body(),
                                       params={"version": version},
                                       headers={"Content-Type": "application/x-grpo-weights"}).json()
        finally:
            while not finished:  # a failed upload keeps draining so the producer never waits on it
                finished = q.get() is _END
