"""Weight fan-out, server side: an `/update_weights` upload given `relay=URL,...` is forwarded, byte for byte as it is
read, to the first of those servers (one chunked POST naming the rest), so the trainer sends each byte once for the
whole chain. Every server checks every frame itself; the answer carries the answers of the servers after it."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from grpo_cli.rollout.transport import wire
from grpo_cli.rollout.transport.http_client import error_text

_END = None
RELAY_TIMEOUT_S = 600.0
"""Longest wait on one socket operation of the forwarded upload, or for the next server's answer."""
QUEUE_PIECES = 256
"""Pieces read and not yet forwarded (each at most one socket read, ~64 KiB to a few MiB): a slow next server holds
the upstream back instead of filling this server's memory."""


class Relay:
    """The forwarded upload to `chain[0]` (which forwards to `chain[1:]`), fed by `tee_readinto` / `tee_chunks` and
    ended by `close`; `answers()` is the chain's answers, or one `{"url", "error"}` entry for the first that failed."""

    def __init__(self, chain: list[str], *, version: int, headers: dict[str, str]) -> None:
        self.next, self.rest = chain[0], chain[1:]
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_PIECES)
        self._params = {"version": version, **({"relay": ",".join(self.rest)} if self.rest else {})}
        self._headers = {**headers, "Content-Type": "application/x-grpo-weights"}
        self._answer: dict | None = None
        self._error: str | None = None
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="weights-relay", daemon=True)
        self._thread.start()

    def tee_readinto(self, readinto: Callable[[memoryview], int]) -> Callable[[memoryview], int]:
        def read(view: memoryview) -> int:
            n = readinto(view)
            if n:
                self._queue.put(bytes(view[:n]))  # a copy: the frame buffer is reused
            return n
        return read

    def tee_chunks(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self._queue.put(chunk)
            yield chunk

    def close(self) -> None:
        """The upload ended here (whole, or cut by a failure: the next server then fails on the cut stream)."""
        self._queue.put(_END)

    def answers(self) -> list[dict]:
        """The next server's answer and those it relayed, after `close`; a failure ends the list with its entry."""
        self._thread.join(RELAY_TIMEOUT_S)
        if self._thread.is_alive():
            return [{"url": self.next, "error": f"no answer within {RELAY_TIMEOUT_S:g} s"}]
        if self._error is not None:
            return [{"url": self.next, "error": self._error}]
        answer = dict(self._answer or {})
        return [answer, *answer.pop("relayed", [])]

    def _pieces(self) -> Iterator[bytes]:
        while (piece := self._queue.get()) is not _END:
            yield piece
        self._ended = True

    def _run(self) -> None:
        try:
            resp = wire.post_chunked(self.next, "/update_weights", self._pieces(), params=self._params,
                                     headers=self._headers, connect_timeout=10.0, timeout=RELAY_TIMEOUT_S)
            if resp.status_code >= 400:  # noqa: PLR2004
                self._error = f"answered {resp.status_code}: {error_text(resp)}"
            else:
                self._answer = resp.json()
        except Exception as e:  # noqa: BLE001 - reported to the trainer in this server's answer
            self._error = f"{type(e).__name__}: {e}"
        finally:
            while not self._ended:  # a failed relay keeps draining: the upload never waits on it
                self._ended = self._queue.get() is _END
