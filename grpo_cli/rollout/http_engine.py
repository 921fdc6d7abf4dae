"""`HttpServerEngine`: what the three clients of rollout servers over HTTP share (`remote` for `grpo serve-rollout`,
`sglang`, `vllm_serve`): one `HttpClient` with the `rollout.server` policy over the server URLs, a thread pool for
the requests in flight, the weight transport `rollout.transport` names (built through the transport registry under
the client's name), the routing of requests over the servers (`rollout/routing.py`), the fields every `from_config`
reads from `rollout.server`, closing all three, and `model_identity` (what a server's model must match)."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from grpo_cli.rollout.base import RolloutEngine, RolloutError, SamplingParams
from grpo_cli.rollout.routing import CacheMeter, Router, prefix_cache_counters
from grpo_cli.rollout.transport import base as transports
from grpo_cli.rollout.transport.http_client import HttpClient, Policy

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.base import EngineContext


def model_identity(model_path: str) -> dict:
    """vocab_size and architectures from a checkpoint's config.json (what `/info` must match)."""
    cfg_file = Path(model_path) / "config.json"
    if not cfg_file.is_file():
        return {}
    cfg = json.loads(cfg_file.read_text())
    text = cfg.get("text_config") or {}
    return {"vocab_size": cfg.get("vocab_size", text.get("vocab_size")), "architectures": cfg.get("architectures")}


class HttpServerEngine(RolloutEngine):
    """Base of the server clients. A subclass names its registry `client` and its threads, calls `_open` first in
    its `__init__`, and gives `from_config` its own arguments through `config_args`."""

    shares_policy_weights = False
    push_from_main_only = True
    client: ClassVar[str]
    """This client's name in the weight-transport registry."""
    rank: int = 0
    """The training process this client generates for (`EngineContext.rank`): every rank sends the step's seed, and
    the requests' seeds are keyed by it (`rollout/seeds.py`) so two ranks never draw the same noise."""
    thread_name_prefix: ClassVar[str]
    lengths: tuple[int, int] | None = None
    """(`data.max_prompt_length`, `rollout.max_completion_length`) of the run, set by `from_config` before it
    connects: the longest sequence every server must hold (`check_served_length`)."""

    def _open(self, urls: list[str], *, token: str | None, policy: Policy | None, transport: str, offered: dict,
              workers: int | None = None) -> None:
        """The HTTP client, the request pool (`workers`, default one per server) and the weight transport; the
        weight version starts at 0 until the servers report theirs."""
        self.policy = policy or Policy()
        self.http = HttpClient(urls, token=token, policy=self.policy)
        self.urls = self.http.urls
        self.weight_version = 0
        self._calls = 0
        self._pool = ThreadPoolExecutor(max_workers=workers or max(1, len(self.urls)),
                                        thread_name_prefix=self.thread_name_prefix)
        self._weights = transports.create(transport, transports.Link(self.http, self.urls, self._pool),
                                          client=self.client, offered=offered)
        self.router = Router(len(self.urls), max_excess=self.policy.sticky_max_excess)
        self._call_ids = itertools.count()
        self._local = threading.local()  # this thread's first-turn call and pending later-turn keys
        self._cache_meter = CacheMeter(len(self.urls))

    # -- routing (rollout/routing.py) -----------------------------------------------------------------------
    def _place(self, count: int, weight: int) -> list[int]:
        """Servers for the next `count` prompts of `weight` requests each: later turns of trajectories where
        `generate_turn` said so, else new groups by load (remembered as this thread's first-turn call)."""
        keys = getattr(self._local, "turns", None)
        if keys is not None:
            self._local.turns = None
            return self.router.place_turns(keys, weight)
        call = next(self._call_ids)
        self._local.call = call
        return self.router.place_new([(call, i) for i in range(count)], weight)

    def _routed(self, server: int, weight: int, fn: Callable, *args):
        """`fn(*args)`, a request placed on `server`; its load is released however it ends."""
        try:
            return fn(*args)
        finally:
            self.router.done(server, weight)

    def generate_turn(self, prompt_ids: list[list[int]], sampling: SamplingParams, first: list[int]):
        """Later turns go where their first turn went (that server caches their prefix), within the load bound."""
        call = getattr(self._local, "call", None)
        self._local.turns = None if call is None else [(call, g) for g in first]
        return self.generate(prompt_ids, sampling)

    def _prefix_cache_metrics(self) -> dict[str, float]:
        """The servers' prefix-cache hit rate since the last call, from their Prometheus `/metrics` where they serve
        vLLM's counters (`rollout/routing.py`); a server that does not is left out."""
        readings = []
        for url in self.urls:
            try:
                resp = self.http.request(url, "GET", "/metrics", timeout=5.0)
                readings.append(prefix_cache_counters(resp.text) if resp.status_code == 200 else None)  # noqa: PLR2004
            except Exception:  # noqa: BLE001 - a metric, never a reason to fail the step
                readings.append(None)
        return self._cache_meter.take_metrics(readings)

    @classmethod
    def from_config(cls, cfg: GRPOConfig, ctx: EngineContext) -> HttpServerEngine:
        s = cfg.rollout.server
        engine = cls(list(s.urls), policy=Policy.of(s), stop_token_ids=ctx.eos_token_ids,
                     chunk_mb=s.weight_chunk_mb, connect=False, **cls.config_args(cfg, ctx))
        engine.rank = ctx.rank
        engine.lengths = (cfg.data.max_prompt_length, cfg.rollout.max_completion_length)
        engine.connect()
        return engine

    def connect(self) -> None:
        """Wait for the servers and check each against the run (model, flags, `check_served_length`)."""
        raise NotImplementedError

    def check_served_length(self, url: str, limit: int | None, *, what: str, flag: str,
                            exclusive: bool = False) -> None:
        """Refuse a server started for shorter sequences than the run's longest (`lengths`), at connect rather than
        at the first long prompt hours in. `limit`: the length the server reports (None: not reported, nothing to
        check); `flag`: its start option; `exclusive`: the server refuses a prompt + completion equal to `limit`
        (SGLang's context length), so it must be one more than the sum."""
        if limit is None or self.lengths is None:
            return
        prompt, completion = self.lengths
        need = prompt + completion + (1 if exclusive else 0)
        if need > int(limit):
            raise RolloutError(
                f"{what} at {url} was started with {flag} {limit}, but this run's sequences reach "
                f"data.max_prompt_length {prompt} + rollout.max_completion_length {completion} = "
                f"{prompt + completion} tokens" + (" (it refuses a prompt + completion that reaches its limit)"
                                                   if exclusive else "")
                + f": the longest ones would be refused or cut mid-run. Restart it with {flag} {need} (or more), or "
                "lower data.max_prompt_length / rollout.max_completion_length to fit.")

    @classmethod
    def config_args(cls, cfg: GRPOConfig, ctx: EngineContext) -> dict:
        """This client's constructor arguments besides the URLs, policy, stop tokens and chunk size."""
        raise NotImplementedError

    def close(self) -> None:
        self._weights.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()
