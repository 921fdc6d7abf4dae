"""The weight stream read straight from the connection's socket (`recv_into` the frame buffer), past uvicorn.

Through ASGI every body chunk is copied twice by uvicorn (`cycle.body += chunk`, then `bytes(cycle.body)` for the
message), handed across the event loop, and its reading paused and resumed every 64 KiB; at loopback speed that
was most of what the server spent on an HTTP sync besides the engine's own copy. A client that sends
`Expect: 100-continue` (ours, `rollout/transport/wire.py`) waits for the server's `100 Continue` before the first
byte of its body, so when the app takes the request, uvicorn has read its headers and nothing after them. `take`
then stops the event loop reading the connection, answers `100 Continue` itself and lets the engine's worker thread
read the chunked body from a duplicate of the socket's descriptor (`ChunkedSocket.readinto`, most bytes straight
into the frame buffer). The connection is closed after the response (its HTTP parser never saw the body).

Auth is unchanged (the Guard middleware checks the token before the app sees the request); frame, version and
count checks are the same code as the ASGI path (`codec.FrameReader`, `codec.checked_frames`). Anything else (no
`Expect` header, another ASGI server, an uvicorn whose request cycle does not look as expected) takes the ASGI path.
"""

from __future__ import annotations

import os
import socket

from grpo_cli.rollout.transport.codec import FrameError

MAX_LINE = 4096
"""Longest chunk-size or trailer line accepted (chunk extensions included)."""


def take(scope: dict, receive, *, timeout_s: float) -> ChunkedSocket | None:
    """The request's chunked body as a `ChunkedSocket`, or None where it must be read through ASGI."""
    headers = dict(scope.get("headers", ()))
    if headers.get(b"expect", b"").lower() != b"100-continue":
        return None
    if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
        return None
    cycle = getattr(receive, "__self__", None)  # uvicorn's RequestResponseCycle (h11 and httptools alike)
    transport, flow = getattr(cycle, "transport", None), getattr(cycle, "flow", None)
    if not (all(hasattr(transport, m) for m in ("write", "get_extra_info", "is_closing"))  # asyncio or uvloop
            and getattr(cycle, "waiting_for_100_continue", False)
            and hasattr(flow, "pause_reading") and hasattr(cycle, "keep_alive")):
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        return None
    flow.pause_reading()  # the event loop reads this connection no more
    cycle.keep_alive = False  # its parser is left mid-request: close after the response (errors included)
    cycle.waiting_for_100_continue = False
    raw = socket.socket(fileno=os.dup(sock.fileno()))
    raw.settimeout(timeout_s)
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return ChunkedSocket(raw)


class ChunkedSocket:
    """Reads an HTTP/1.1 chunked body from a blocking socket. `readinto(view)` fills `view` with the next body
    bytes (0 at the end of the body): control lines go through a small staging buffer, chunk data straight into
    `view` unless it arrived in the staging buffer with a control line."""

    def __init__(self, sock: socket.socket, *, stage_bytes: int = 64 << 10) -> None:
        self.sock = sock
        self._stage = bytearray(stage_bytes)
        self._start = self._end = 0  # unread bytes of the staging buffer: [_start, _end)
        self._left = 0  # data bytes left in the current chunk
        self.done = False
        self.bytes = 0

    def readinto(self, view: memoryview) -> int:
        if self.done or not len(view):
            return 0
        if self._left == 0:
            self._next_chunk()
            if self.done:
                return 0
        want = min(len(view), self._left)
        if self._end > self._start:  # data that came in with a control line
            n = min(want, self._end - self._start)
            view[:n] = self._stage[self._start : self._start + n]
            self._start += n
        else:
            n = self.sock.recv_into(view[:want])
            if n == 0:
                raise FrameError("the client closed the connection inside the weight stream")
        self._left -= n
        self.bytes += n
        if self._left == 0:
            self._expect_crlf()
        return n

    def drain(self) -> None:
        """Read and drop the rest of the body (a failed update: the client then reads the answer, not a reset)."""
        scratch = memoryview(bytearray(1 << 20))
        try:
            while self.readinto(scratch):
                pass
        except (OSError, FrameError):
            pass

    def close(self) -> None:
        self.sock.close()

    def _next_chunk(self) -> None:
        line = self._line()
        size = line.split(b";", 1)[0].strip()
        try:
            self._left = int(size, 16)
        except ValueError:
            raise FrameError(f"malformed chunk size {bytes(size[:40])!r} in the weight stream") from None
        if self._left < 0 or size[:1] in (b"-", b"+"):
            raise FrameError(f"malformed chunk size {bytes(size[:40])!r} in the weight stream")
        if self._left == 0:
            while self._line():  # trailer fields, up to the empty line
                pass
            self.done = True

    def _expect_crlf(self) -> None:
        if self._line():
            raise FrameError("a chunk of the weight stream is longer than its announced size")

    def _line(self) -> bytes:
        """The next CRLF-terminated line (without it), read into the staging buffer as needed."""
        while True:
            at = self._stage.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._stage[self._start : at])
                self._start = at + 2
                return line
            if self._start:  # move what is left to the front
                left = self._end - self._start
                self._stage[:left] = self._stage[self._start : self._end]
                self._start, self._end = 0, left
            if self._end > MAX_LINE or self._end == len(self._stage):
                raise FrameError("a chunk-size line of the weight stream is too long")
            n = self.sock.recv_into(memoryview(self._stage)[self._end :])
            if n == 0:
                raise FrameError("the client closed the connection inside the weight stream")
            self._end += n
