"""Stream mode's side of the `vllm serve` client (docs/streaming.md): one prompt group per request, the weight
version of every sampled token read from vLLM's `weight_versions` spans (never guessed), and the in-flight weight
update: `/pause?mode=keep` on every server, the verified RL round, then `/resume`, so that requests in flight
continue under the new weights. The pool places each group by `rollout/routing.least_loaded`.

vLLM 0.32's pause with `mode=keep` freezes every request where it is (`PauseState.PAUSED_ALL`) and queues new ones;
nothing runs until `/resume`: a server left paused (a trainer killed between pause and resume) queues every later
generate, the weight probe's included, forever, which is what left the next round "hanging". So every round of a
streaming client ends with `/resume`, and a client that finds a server paused at connect aborts the requests a dead
trainer left there and resumes it (`release_paused`). `clear_cache=false`
keeps the KV the running requests computed under the old weights (the round's prefix-cache reset then cannot
succeed: those requests hold blocks); `clear_cache=true` (`rollout.stream.recompute_kv`) preempts them at the pause
and vLLM re-prefills prompt + tokens so far when they resume, under the new weights. Every request carries its own
`cache_salt`, so no request ever reuses the prefix KV of another (which may be older weights').

A round's checks (the version each server reports, the checksums, the logprob probe) run after `/resume` on one
background thread while the trainer trains its next step (`DeferredChecks`): with the servers busy, a probe waits
behind every request in flight, and the trainer waiting for it was half a step on this machine. The next sync
settles them before it pauses anything (`weight_sync.sync_weights`), as does every checkpoint and the run's end
(`weight_sync.settle_deferred`), so a failed check stops the run before a checkpoint holds a step trained on tokens
of unverified weights."""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

from grpo_cli.rollout.base import RolloutError

PAUSE = "/pause"
RESUME = "/resume"
IS_PAUSED = "/is_paused"
ABORT = "/abort_requests"
_salts = itertools.count()
PAUSE_SETTLE_S = 0.02
"""What vLLM 0.32's `/pause` waits after the engine has paused, before it answers (`AsyncLLM.pause_generation`,
vllm/v1/engine/async_llm.py: `await asyncio.sleep(0.02)` after `pause_scheduler_async`). The engine core pauses
between two of its steps, so `/pause` first waits for the step running (the engine generating); the engine is idle
from about `answered - PAUSE_SETTLE_S`, not from when the pause was sent."""


def request_salt() -> str:
    """A `cache_salt` no other request of this process carries (vLLM hashes it into the first block of the prompt:
    the G samples of one request share their prompt's KV, no two requests do)."""
    return f"grpo-{os.getpid()}-{next(_salts)}"


def parse_span_version(text) -> int | None:
    """A span's version label as our integer (`"7"`), or None for a label this client never sets."""
    return int(text) if isinstance(text, str) and text.isdigit() else None


def token_versions(url: str, spans: list[dict] | None, count: int, *, pushed: range) -> list[int]:
    """The weight version of each of `count` sampled tokens from vLLM's spans `[{version, start, end}]`, which must
    tile `[0, count)` in order with versions this run pushed (`pushed`); anything else is a RolloutError: a token's
    version is read from the server, never guessed."""
    if count and not spans:
        raise RolloutError(f"vllm serve at {url} returned {count} tokens without weight_versions spans; stream mode "
                           "needs the version of every token (vLLM >= 0.32's token-in/token-out route reports them)")
    out: list[int] = []
    for span in spans or []:
        version = parse_span_version(span.get("version"))
        start, end = span.get("start"), span.get("end")
        if start != len(out) or not isinstance(end, int) or end < start:
            raise RolloutError(f"vllm serve at {url}: weight_versions spans {spans} do not tile the {count} tokens "
                               "returned in order")
        if version not in pushed:
            raise RolloutError(f"vllm serve at {url} sampled tokens with weights {span.get('version')!r}, which this "
                               f"run did not push (it pushed v{pushed.start}..v{pushed.stop - 1}): did the server "
                               "restart, or does another trainer push to it? Give the run its own server and resume.")
        out += [version] * (end - start)
    if len(out) != count:
        raise RolloutError(f"vllm serve at {url}: weight_versions spans {spans} cover {len(out)} of {count} tokens")
    return out


@dataclass
class Group:
    """One finished prompt group: G completions of one prompt with each token's sampler logprob and weight version."""

    index: int
    """The group's place in submission order (its seed and its prompt's cursor position follow from it)."""
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    token_versions: list[list[int]]
    finish_reasons: list[str]
    submitted_version: int
    """The version the trainer had pushed when the group was submitted (its first tokens may be that or newer)."""
    url: str = ""
    seconds: float = 0.0
    cursor_before: dict = field(default_factory=dict)

    def oldest(self) -> int | None:
        """The oldest version of any of its tokens (None: no token was sampled)."""
        return min((v for row in self.token_versions for v in row), default=None)

    def mixed_rows(self) -> int:
        """Completions whose tokens span more than one weight version."""
        return sum(len(set(row)) > 1 for row in self.token_versions)


class InFlightUpdates:
    """Pause with requests kept → `round()` → resume, on every server of a client (`http`, `urls`, `pool`)."""

    def __init__(self, http, urls: list[str], pool, *, recompute_kv: bool) -> None:
        self.http, self.urls, self.pool, self.recompute_kv = http, urls, pool, recompute_kv
        self.paused_seconds = 0.0
        """Time the servers spent paused for weight updates, per server (the mean over them), summed over rounds:
        from each server's pause (`paused_since`) to its `/resume` answer (`stream/engine_idle_frac` counts it)."""
        self._paused_at: dict[str, float] = {}
        self.count_requests = lambda: 0
        """The client's requests in flight now (the stream pool sets it: its groups still generating)."""
        self.requests_at_pause = 0
        """Requests in flight when the last pause began: they continue under the new weights after the resume."""

    def _all(self, path: str, **kw) -> dict[str, float]:
        """POST `path` to every server at once; when each answered (`time.perf_counter()`)."""
        def one(url: str) -> float:
            self.http.call(url, "POST", path, idempotent=False, **kw)
            return time.perf_counter()

        futures = {url: self.pool.submit(one, url) for url in self.urls}
        return {url: f.result() for url, f in futures.items()}

    def paused_servers(self) -> list[str]:
        return [u for u in self.urls if self.http.request(u, "GET", IS_PAUSED).json().get("is_paused") is True]

    def release_paused(self) -> list[str]:
        """At connect: a server found paused holds a dead trainer's requests (their KV blocks too, so no prefix-cache
        reset could succeed) and queues every new one; abort them all and resume it. Returns those servers."""
        found = self.paused_servers()
        for url in found:
            self.http.call(url, "POST", ABORT, idempotent=False, json={})
            self.http.call(url, "POST", RESUME, idempotent=False)
        return found

    def pause(self) -> None:
        sent = time.perf_counter()
        self.requests_at_pause = self.count_requests()
        answered = self._all(PAUSE, params={"mode": "keep", "clear_cache": "true" if self.recompute_kv else "false"})
        self._paused_at = {url: paused_since(sent, at) for url, at in answered.items()}

    def resume(self) -> None:
        answered = self._all(RESUME)
        self.paused_seconds += sum(at - self._paused_at.get(url, at) for url, at in answered.items()) / len(answered)


def paused_since(sent: float, answered: float) -> float:
    """When a server's engine stopped generating, for a `/pause` sent at `sent` and answered at `answered`:
    `answered - PAUSE_SETTLE_S`, never before it was sent."""
    return max(sent, answered - PAUSE_SETTLE_S)


class DeferredChecks:
    """A weight round's checks, run in submission order on one background thread; `settle()` waits for them all."""

    THREAD = "grpo-sync-check"

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.THREAD)
        self._pending: list[Future] = []

    @classmethod
    def inside(cls) -> bool:
        """Whether the caller is one of the checks (a check asked to defer itself runs now instead)."""
        return threading.current_thread().name.startswith(cls.THREAD)

    def submit(self, check: Callable[[], dict | None]) -> None:
        self._pending.append(self._pool.submit(check))

    def defer(self, check: Callable[[], dict | None]) -> bool:
        """An engine's `probe_when_awake`: `check` submitted (True), or False inside a check (it runs now)."""
        if self.inside():
            return False
        self.submit(check)
        return True

    def settle(self) -> dict[str, float]:
        """Wait for every check submitted; the figures they returned (merged in order), or the first failure raised
        (the later ones are dropped: the run stops)."""
        pending, self._pending = self._pending, []
        figures: dict[str, float] = {}
        for future in pending:
            figures.update(future.result() or {})
        return figures

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
