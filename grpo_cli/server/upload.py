"""The body of a streamed weight upload (`/update_weights`), read on the event loop while the engine's thread decodes
and loads what came before it.

Receiving and loading overlap: `fill` (a task on the event loop) reads the request stream into a queue, holding at
most about `limit` bytes ahead of the consumer, and `chunks()` (the engine's worker thread) takes them in order. The
earlier code pulled ~8 MB at a time from the worker thread (`anyio.from_thread.run`) and read nothing while it decoded
and loaded them, so uvicorn paused the socket (its flow control stops reading past 64 KiB unread) and the network
and the loading took turns. After `discard()` (a failed update) the rest of the body is read and dropped, so the
client gets the server's 4xx answer instead of a broken pipe."""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator, Iterator

import anyio

_END = None


class StreamedBody:
    def __init__(self, stream: AsyncIterator[bytes], *, limit: int = 64 << 20) -> None:
        self.stream, self.limit = stream, limit
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Condition()
        self._waiting = 0  # bytes read and not yet taken by the consumer
        self._dropping = False

    async def fill(self) -> None:
        """Read the whole body (never raises: a failed read reaches the consumer as its exception)."""
        try:
            async for chunk in self.stream:
                if self._dropping:
                    continue
                with self._room:
                    self._waiting += len(chunk)
                    full = self._waiting > self.limit
                self._queue.put(chunk)
                if full:
                    await anyio.to_thread.run_sync(self._wait_for_room)
        except Exception as e:  # noqa: BLE001 - the client went away mid-body: the consumer raises it
            self._queue.put(e)
        finally:
            self._queue.put(_END)

    def _wait_for_room(self) -> None:
        with self._room:
            self._room.wait_for(lambda: self._waiting <= self.limit // 2 or self._dropping)

    def chunks(self) -> Iterator[bytes]:
        """The body's chunks in order (blocks until each arrives); a failed read raises here."""
        while (chunk := self._queue.get()) is not _END:
            if isinstance(chunk, Exception):
                raise chunk
            with self._room:
                self._waiting -= len(chunk)
                self._room.notify()
            yield chunk

    def discard(self) -> None:
        """Drop the rest of the body as it is read (the update failed)."""
        with self._room:
            self._dropping = True
            self._room.notify()
