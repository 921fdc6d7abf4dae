"""`app_in_thread`: serve an ASGI app on 127.0.0.1 from a thread. A module of its own (not conftest) so that
`from served_app import ...` cannot resolve to another folder's conftest."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


@contextmanager
def app_in_thread(app):
    """Serve an ASGI app on 127.0.0.1:<free port> from a daemon thread; yields its URL."""
    import uvicorn

    from grpo_cli.server.launch import bind, url_of

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


def image_of(seed: int, size=(56, 56)):
    """A random RGB image (seeded)."""
    import torch
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy())
