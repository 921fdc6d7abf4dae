"""HTTP client side shared by the rollout clients and the weight transports that talk HTTP: timeouts on every call,
bounded retries with backoff, the server's own error text in every exception, and a named exception for a server
that went away."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import httpx

from grpo_cli.config.transports import is_loopback
from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.transport import wire

RETRY_STATUS = {502, 503, 504}
HEALTH_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
"""One `/health` probe while waiting for a server to come back."""
HEALTH_PROBE_S = 7.0
"""The longest one such probe takes (connect + read)."""


class RolloutServerDown(RolloutError):
    """A rollout server stopped answering mid-run. `recovered` says whether it answered `/health` again within
    `wait_for_recovery_s` (on_failure=wait); the caller then pushes the weights again and retries the step.
    Otherwise the caller saves a checkpoint and stops."""

    def __init__(self, message: str, *, url: str, recovered: bool = False) -> None:
        super().__init__(message)
        self.url = url
        self.recovered = recovered


@dataclass(frozen=True)
class Policy:
    """Timeouts and failure handling of one client (mirrors `rollout.server.*`)."""

    connect_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    retries: int = 3
    on_failure: str = "stop"
    wait_for_recovery_s: float = 300.0
    backoff_s: float = 0.5
    sticky_max_excess: int = 16

    @classmethod
    def of(cls, server_config) -> Policy:
        """The policy `rollout.server` sets (its fields of the same names; `backoff_s` keeps its default)."""
        return cls(**server_config.model_dump(include={f.name for f in dataclasses.fields(cls)}))

    def worst_case_s(self, *, idempotent: bool) -> float:
        """The longest `HttpClient.call` may take before it answers or raises: each attempt's connect and read
        timeouts, the back-offs between attempts, then with `on_failure: wait` the wait for recovery (its last
        `/health` probe may overrun it by one probe's timeout) and the one retried request. Defaults, not idempotent:
        610 s under `stop`, 1527 s under `wait` (a NCCL group's timeout must exceed it: `transport.nccl`)."""
        attempt = min(10.0, self.connect_timeout_s) + self.request_timeout_s
        tries = 1 + (self.retries if idempotent else 0)
        total = tries * attempt + sum(self.backoff_s * 2**i for i in range(tries - 1))
        if self.on_failure == "wait":
            total += self.wait_for_recovery_s + HEALTH_PROBE_S + attempt
        return total


def proxy_hint(url: str) -> str:
    """Proxies hijacking a rollout server's address are a classic cause of 'server not up' (say so)."""
    if is_loopback(url):
        return ""
    set_vars = [v for v in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY") if os.environ.get(v)]
    if not set_vars:
        return ""
    return f" ({', '.join(set_vars)} is set: add the server's host to no_proxy if it is not behind the proxy)"


def error_text(resp: httpx.Response) -> str:
    """The server's message: `error`/`detail`/`message` of a JSON body, else the first 500 characters."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500].strip() or resp.reason_phrase
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if body.get(key):
                value = body[key]
                return value if isinstance(value, str) else str(value)[:500]
    return str(body)[:500]


class HttpClient:
    """One `httpx.Client` per base URL (loopback URLs ignore proxy variables), with `call` doing the retries."""

    def __init__(self, urls: Sequence[str], *, token: str | None, policy: Policy) -> None:
        if not urls:
            raise RolloutError("no rollout server URL given: set rollout.server.urls (e.g. [http://127.0.0.1:8000])")
        self.urls = [u.rstrip("/") for u in urls]
        self.policy = policy
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.clients = {
            u: httpx.Client(base_url=u, headers=self.headers, trust_env=not is_loopback(u),
                            timeout=httpx.Timeout(policy.request_timeout_s,
                                                  connect=min(10.0, policy.connect_timeout_s)))
            for u in self.urls
        }

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def request(self, url: str, method: str, path: str, *, timeout: float | None = None, **kw) -> httpx.Response:
        """One attempt; HTTP errors become RolloutError with the server's text, transport errors propagate."""
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=min(10.0, timeout))
        return self._refused(url, path, self.clients[url].request(method, path, **kw))

    @staticmethod
    def _refused(url: str, path: str, resp: httpx.Response) -> httpx.Response:
        """`resp`, unless it is an error that retrying cannot fix: then RolloutError with the server's text."""
        if resp.status_code >= 400 and resp.status_code not in RETRY_STATUS:
            hint = " (set the token variable named by rollout.server.token_env to the server's token)" \
                if resp.status_code == 401 else ""
            raise RolloutError(f"rollout server {url}{path} answered {resp.status_code}: {error_text(resp)}{hint}")
        return resp

    def upload(self, url: str, path: str, pieces: Iterable, *, params: dict, headers: dict[str, str]) -> httpx.Response:
        """POST a streamed body (not idempotent: no retry; the on_failure policy after a failure). Plain-http URLs
        get it written to the socket piece by piece (`wire.post_chunked`), others through httpx in slices."""
        if not wire.usable(url, loopback=is_loopback(url)):
            return self.call(url, "POST", path, idempotent=False, content=wire.sliced(pieces), params=params,
                             headers=headers)
        try:
            resp = wire.post_chunked(url, path, pieces, params=params, headers={**self.headers, **headers},
                                     connect_timeout=min(10.0, self.policy.connect_timeout_s),
                                     timeout=self.policy.request_timeout_s)
        except OSError as e:
            return self._on_failure(url, "POST", path, f"{type(e).__name__}: {e}", None, {})
        if resp.status_code in RETRY_STATUS:
            return self._on_failure(url, "POST", path, f"{resp.status_code}: {error_text(resp)}", None, {})
        return self._refused(url, path, resp)

    def call(self, url: str, method: str, path: str, *, idempotent: bool = True,
             verify_after_recovery: Callable[[str], bool] | None = None, **kw) -> httpx.Response:
        """`request` with bounded retries (idempotent calls only) and the on_failure policy after them.

        After a recovery, `verify_after_recovery(url)` says whether the server still holds our state (then the
        call is retried once more); otherwise RolloutServerDown(recovered=True) tells the caller to re-sync."""
        attempts = 1 + (self.policy.retries if idempotent else 0)
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                resp = self.request(url, method, path, **kw)
                if resp.status_code not in RETRY_STATUS:
                    return resp
                last = RolloutError(f"{resp.status_code}: {error_text(resp)}")
            except httpx.TransportError as e:
                last = e
            if attempt + 1 < attempts:
                time.sleep(self.policy.backoff_s * 2**attempt)
        what = f"{type(last).__name__}: {last}" if isinstance(last, httpx.TransportError) else str(last)
        return self._on_failure(url, method, path, what, verify_after_recovery, kw)

    def post_each(self, urls: list[str], path: str, **kw) -> None:
        """POST the same idempotent request to every server (memory and cache control)."""
        for url in urls:
            self.call(url, "POST", path, **kw)

    def _on_failure(self, url, method, path, what, verify, kw) -> httpx.Response:
        tries = f"{1 + self.policy.retries} attempt(s)"
        if self.policy.on_failure != "wait":
            raise RolloutServerDown(
                f"rollout server {url} stopped answering during {path} after {tries} ({what}); "
                "rollout.server.on_failure=stop: save a checkpoint and stop (restart the server and resume, "
                "or set rollout.server.on_failure=wait)", url=url)
        waited = self.wait_healthy(url, self.policy.wait_for_recovery_s)
        if waited is None:
            raise RolloutServerDown(
                f"rollout server {url} stopped answering during {path} ({what}) and did not come back within "
                f"rollout.server.wait_for_recovery_s={self.policy.wait_for_recovery_s:g} s", url=url)
        if verify is not None and verify(url):
            try:
                return self.request(url, method, path, **kw)
            except httpx.TransportError as e:
                raise RolloutServerDown(f"rollout server {url} failed again during {path}: {e}", url=url) from e
        raise RolloutServerDown(
            f"rollout server {url} went down during {path} ({what}) and came back after {waited:.1f} s without "
            "our weights: push the weights again (update_weights) and retry the step", url=url, recovered=True)

    def wait_healthy(self, url: str, timeout_s: float, *, poll_s: float = 0.5) -> float | None:
        """Poll `/health` until it answers 200; seconds waited, or None after `timeout_s` (bounded)."""
        start = time.monotonic()
        while True:
            try:
                if self.clients[url].get("/health", timeout=HEALTH_TIMEOUT).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            if time.monotonic() - start + poll_s > timeout_s:
                return None
            time.sleep(poll_s)

    def wait_all_healthy(self, timeout_s: float, hint: Callable[[str], str]) -> None:
        """At start: every server must answer `/health` within `timeout_s`, or a message says how to start it."""
        deadline = time.monotonic() + timeout_s
        for url in self.urls:
            if self.wait_healthy(url, max(0.0, deadline - time.monotonic())) is None:
                raise RolloutError(f"no rollout server at {url} after {timeout_s:g} s: start it with "
                                   f"`{hint(url)}`{proxy_hint(url)}")


def split_groups(num_prompts: int, num_servers: int, offset: int) -> list[tuple[int, slice]]:
    """Contiguous prompt slices, one per server (groups stay whole: a prompt's n samples go to one server),
    servers taken round-robin starting at `offset` so small batches spread across calls."""
    k = min(num_servers, num_prompts)
    base, extra = divmod(num_prompts, k) if k else (0, 0)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(((offset + i) % num_servers, slice(start, start + size)))
        start += size
    return out
