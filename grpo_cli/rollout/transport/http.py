"""`http` weight transport: the frames of `codec.encode_stream` streamed as one chunked POST `/update_weights` per
server, all servers at once from one encoding (a bounded queue per upload), so the trainer holds about one frame.
Each piece of a frame (a tensor's bytes) goes to the socket as it is, no copy of ours (`wire.post_chunked`; through
httpx in 256 KiB views where a proxy or TLS is in the way, `HttpClient.upload`). With `relay` (the default) and
several servers, one upload goes to the first, which forwards it to the next as it reads it, and so on
(`server/relay.py`): the trainer sends each byte once, whatever the number of servers."""

from __future__ import annotations

import queue
from collections.abc import Iterator

from grpo_cli.rollout.transport import codec
from grpo_cli.rollout.transport.base import Link, NamedTensors, WeightTransport
from grpo_cli.rollout.transport.http_client import RolloutServerDown

_END = object()


class HttpTransport(WeightTransport):
    name = "http"
    takes = ("relay",)

    def __init__(self, link: Link, *, relay: bool = True) -> None:
        super().__init__(link)
        self.relay = relay

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        urls, pool = self.link.urls, self.link.pool
        if self.relay and len(urls) > 1:
            return self._relayed(named_tensors, version, chunk_bytes)
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

    def _relayed(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        """One upload along the chain urls[0] → urls[1] → ...; each server's own answer, in order. A server that
        failed inside the chain is named (RolloutServerDown: the run's on_failure policy applies)."""
        first, *rest = self.link.urls
        frames = codec.encode_stream(named_tensors, chunk_bytes=chunk_bytes, version=version)
        answer = self.link.http.upload(first, "/update_weights", (piece for frame in frames for piece in frame),
                                       params={"version": version, "relay": ",".join(rest)},
                                       headers={"Content-Type": "application/x-grpo-weights"}).json()
        answers = [answer, *answer.pop("relayed", [])]
        for a in answers:
            if "error" in a:
                raise RolloutServerDown(f"rollout server {a['url']} failed during the relayed weight update to "
                                        f"v{version} ({a['error']}): restart it (or take it out of rollout.server.urls); "
                                        "the servers before it in the chain hold the new weights", url=a["url"])
        if len(answers) != len(self.link.urls):
            raise RolloutServerDown(f"the relayed weight update reached {len(answers)} of {len(self.link.urls)} "
                                    "servers", url=self.link.urls[len(answers)])
        return answers

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
