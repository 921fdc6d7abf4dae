"""A streamed POST written to a plain socket: the weight stream of the `http` transport without httpx.

httpx/httpcore copy every piece of a streamed body at least twice in Python (h11 joins a chunk's framing and data
into one `bytes`; httpcore's send loop re-slices what is left after each partial `send`), so `http.py` had to hand
them 256 KiB views to keep that cheap. Here each piece of a frame (a tensor's bytes) goes to the kernel in one
`sendall` of a view of the tensor, framed as an HTTP/1.1 chunk: the request is ordinary HTTP (chunked, with
`Expect: 100-continue`), so a server or proxy that knows nothing of this reads it as any other; ours reads it
straight from the socket (`server/raw_body.py`). The client waits for `100 Continue` before sending the body, so a
refused request (401, a bad version) costs no upload.

Used for plain `http://` URLs that no proxy variable redirects (`usable`); anything else goes through httpx."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from urllib.parse import urlencode, urlsplit

import httpx

SEND_BYTES = 256 << 10
"""Largest piece of the body handed to httpx at once (the httpx path, see `sliced`)."""

CONTINUE_WAIT_S = 5.0
"""How long the client waits for `100 Continue` before sending the body anyway."""
_PROXY_VARS = ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")


def usable(url: str, *, loopback: bool) -> bool:
    """Whether `post_chunked` can reach `url` the way httpx would: plain http, and no proxy variable in play
    (httpx ignores them for loopback URLs, see `HttpClient`)."""
    return urlsplit(url).scheme == "http" and (loopback or not any(os.environ.get(v) for v in _PROXY_VARS))


def sliced(pieces: Iterable) -> Iterable[memoryview]:
    """Pieces as views of at most SEND_BYTES each, for httpx: httpcore writes a buffer with
    `while buffer: buffer = buffer[sock.send(buffer):]`, which copies what is left of a `bytes` buffer after every
    partial send, so a whole 100 MB tensor handed over at once was copied dozens of times (loopback, 403 MB: 71-78
    MB/s for whole pieces against 230-330 with slices of 256 KiB-4 MiB, a drain-only server on a loaded machine)."""
    for piece in pieces:
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), SEND_BYTES):
            yield view[start : start + SEND_BYTES]


def post_chunked(url: str, path: str, pieces: Iterable, *, params: dict, headers: dict[str, str],
                 connect_timeout: float, timeout: float) -> httpx.Response:
    """POST `pieces` (bytes-like, in order) as one chunked body; the server's answer as an `httpx.Response` (read
    whole). Connection and socket errors raise OSError (`socket.timeout` included)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    target = f"{parts.path.rstrip('/')}{path}" + (f"?{urlencode(params)}" if params else "")
    head = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}", "Transfer-Encoding: chunked",
            "Expect: 100-continue", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection((host, port), timeout=connect_timeout) as sock:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        answer = _Answer(sock)
        sock.settimeout(CONTINUE_WAIT_S)
        try:
            status, fields = answer.head()
        except TimeoutError:  # a server that does not answer `Expect` (RFC 9110 10.1.1): send the body anyway
            status, fields = 100, []
        sock.settimeout(timeout)
        if status == 100:
            try:
                _send_body(sock, pieces)
            except OSError:  # the server may have answered and closed (an error): read what it said
                pass
            status, fields = answer.head()
            while status == 100:
                status, fields = answer.head()
        return httpx.Response(status, headers=fields, content=answer.body(fields),
                              request=httpx.Request("POST", url + target))


def _send_body(sock: socket.socket, pieces: Iterable) -> None:
    tail = b""  # the previous chunk's CRLF goes out with the next chunk's size line
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if len(view):
            sock.sendall(tail + b"%x\r\n" % len(view))
            sock.sendall(view)
            tail = b"\r\n"
    sock.sendall(tail + b"0\r\n\r\n")


class _Answer:
    """The response side of the socket: status lines and headers, then a body of Content-Length bytes (or up to
    the close)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(64 << 10)
        self.buf += data
        return bool(data)

    def head(self) -> tuple[int, list[tuple[str, str]]]:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if not self._fill():
                raise ConnectionError("the server closed the connection before answering")
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[: end + 4]
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/") or not rest[:3].isdigit():
            raise ConnectionError(f"not an HTTP answer: {lines[0][:80]!r}")
        fields = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
        return int(rest[:3]), fields

    def body(self, fields: list[tuple[str, str]]) -> bytes:
        length = next((int(v) for k, v in fields if k.lower() == "content-length"), None)
        while length is None or len(self.buf) < length:
            if not self._fill():
                if length is None:
                    break
                raise ConnectionError("the server closed the connection inside its answer")
        return bytes(self.buf if length is None else self.buf[:length])
