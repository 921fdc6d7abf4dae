"""`http` weight transport: the frames of `codec.encode_stream` streamed as one chunked POST `/update_weights` per
server, all servers at once from one encoding (a bounded queue per upload), so the trainer holds about one frame.
Each piece of a frame (a tensor's bytes) goes to the socket as it is, no copy of ours (`wire.post_chunked`; through
httpx in 256 KiB views where a proxy or TLS is in the way, `HttpClient.upload`)."""

from __future__ import annotations

import queue
from collections.abc import Iterator

from grpo_cli.rollout.transport import codec
from grpo_cli.rollout.transport.base import NamedTensors, WeightTransport

_END = object()


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

        def body() -> Iterator:
            nonlocal finished
            while (frame := q.get()) is not _END:
                yield from frame
            finished = True

        try:
            return self.link.http.upload(url, "/update_weights", body(), params={"version": version},
                                         headers={"Content-Type": "application/x-grpo-weights"}).json()
        finally:
            while not finished:  # a failed upload keeps draining so the producer never waits on it
                finished = q.get() is _END
