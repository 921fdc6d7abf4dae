"""One POST with retries, shared by the served rewards (`served_reward_model`, the judge's HTTP clients)."""

from __future__ import annotations

import time
from collections.abc import Callable


def post_json(client, url: str, body: dict, *, retries: int, backoff_s: float = 0.5,
              on_retry: Callable[[], None] | None = None):
    """`client.post(url, json=body)`, sent again after a connection error, a timeout, a 429 or a 5xx up to
    `retries` times (waiting backoff_s · 2^k before try k+1, calling `on_retry` first). Returns the 2xx response;
    raises `httpx.HTTPStatusError` for any other status (at once for a 4xx but 429: not worth repeating), or the
    last transport error."""
    import httpx

    for attempt in range(retries + 1):
        try:
            resp = client.post(url, json=body)
            if resp.status_code < 500 and resp.status_code != 429:
                return resp.raise_for_status()
        except httpx.TransportError:
            if attempt == retries:
                raise
        if attempt == retries:
            resp.raise_for_status()
        if on_retry is not None:
            on_retry()
        time.sleep(backoff_s * 2**attempt)
    raise AssertionError("unreachable")
