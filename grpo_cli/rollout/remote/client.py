"""`server` mode: the trainer's client of one or more `grpo serve-rollout` servers over HTTP; weights go through the
weight transport `rollout.server.weight_transport` names (`rollout.transport`: http, shm or nccl, in buckets of
`weight_chunk_mb`)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from grpo_cli.rollout import images as wire_images
from grpo_cli.rollout.base import RolloutBatch, RolloutError, SamplingParams
from grpo_cli.rollout.http_engine import HttpServerEngine, model_identity
from grpo_cli.rollout.seeds import request_seed
from grpo_cli.rollout.routing import runs
from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown, split_groups

if TYPE_CHECKING:
    import torch

    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.base import EngineContext

__all__ = ["RolloutServerDown", "ServerEngine"]


class ServerEngine(HttpServerEngine):
    """Implements the RolloutEngine protocol over HTTP. Generation is split over `urls` (whole groups per
    server); weights go to every server and the version each reports is checked."""

    client = "serve-rollout"
    thread_name_prefix = "rollout-http"
    push_from_main_only = True
    """One push per job (`train.weights.sync_ranks`): rank 0 uploads (one /dev/shm file with `shm`, the only NCCL peer
    of the servers with `nccl`); every rank generates its own prompts and checks the version of each answer."""

    def __init__(self, urls: list[str], *, policy: Policy | None = None, token: str | None = None,
                 stop_token_ids: list[int] | None = None, expected: dict | None = None,
                 chunk_mb: int = 128, transport: str = "http", shm_keep_file: bool = True, relay: bool = True,
                 start_hint: str = "grpo serve-rollout --model PATH", connect: bool = True) -> None:
        self._open(urls, token=token, policy=policy, transport=transport,
                   offered={"keep_file": shm_keep_file, "relay": relay})
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids else None
        self.expected = expected or {}
        self.chunk_bytes = chunk_mb << 20
        self.start_hint = start_hint
        self.info: dict[str, dict] = {}
        self.dtype: str | None = None
        if connect:
            self.connect()

    @classmethod
    def config_args(cls, cfg: GRPOConfig, ctx: EngineContext) -> dict:
        s = cfg.rollout.server
        return {"token": s.token, "expected": model_identity(ctx.model_path), "transport": cfg.rollout.transport,
                "shm_keep_file": s.shm_keep_file, "relay": s.weight_fanout == "relay",
                "start_hint": f"GRPO_ROLLOUT_TOKEN=... grpo serve-rollout --engine hf --model {ctx.model_path}"}

    # -- start-up ---------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Wait (bounded) for every server's `/health`, then check `/info` against the trainer's model."""
        def hint(url: str) -> str:
            port = urlsplit(url).port
            return f"{self.start_hint} --port {port}" if port else self.start_hint

        self.http.wait_all_healthy(self.policy.connect_timeout_s, hint)
        for url in self.urls:
            info = self.http.call(url, "GET", "/info").json()
            self._check_identity(url, info)
            self.check_served_length(url, info.get("max_model_len"), what="rollout server (grpo serve-rollout)",
                                     flag="--max-model-len")
            self.info[url] = info
        self.dtype = next(iter(self.info.values())).get("dtype")  # what bounds the sync probe's tolerance
        self.accepts_images = all("images" in info.get("capabilities", ()) for info in self.info.values())
        versions = {info.get("weight_version") for info in self.info.values()}
        self.weight_version = max(v for v in versions if isinstance(v, int)) if versions - {None} else 0

    def _check_identity(self, url: str, info: dict) -> None:
        for key in ("vocab_size", "architectures"):
            want, got = self.expected.get(key), info.get(key)
            if want is not None and got is not None and want != got:
                raise RolloutError(f"rollout server {url} serves {info.get('model')!r} with {key}={got!r}, but the "
                                   f"trainer's model has {key}={want!r}: start the server with the trainer's model")

    # -- generation --------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, images=None) -> RolloutBatch:
        """`images` (servers with the `images` capability): each prompt's, sent once with that prompt as PNG data
        URLs (`rollout/images.py`), not once per completion."""
        start = time.perf_counter()
        urls = wire_images.encode(images)
        parts = runs(self._place(len(prompt_ids), sampling.n))  # whole groups per server (rollout/routing.py)
        futures = []
        for server, sl in parts:
            # one request per server slice: the server's engine derives each prompt's seed from this one
            seed = None if sampling.seed is None else request_seed(sampling.seed, rank=self.rank, prompt=sl.start)
            body = {"prompt_ids": prompt_ids[sl], "stop_token_ids": self.stop_token_ids,
                    "sampling": {"n": sampling.n, "max_tokens": sampling.max_tokens,
                                 "temperature": sampling.temperature, "top_p": sampling.top_p,
                                 "top_k": sampling.top_k, "seed": seed}}
            if urls is not None:
                body["images"] = urls[sl]
            futures.append(self._pool.submit(self._routed, server, sampling.n * (sl.stop - sl.start), self._post,
                                             self.urls[server], "/generate", body))
        completions, reasons, logps = [], [], []
        for (server, _), fut in zip(parts, futures, strict=True):
            out = fut.result()
            self._check_version(self.urls[server], out.get("weight_version"))
            completions += out["completion_ids"]
            reasons += out["finish_reasons"]
            logps += out["sampler_logprobs"]
        if len(completions) != len(prompt_ids) * sampling.n:
            raise RolloutError(f"rollout servers returned {len(completions)} completions for "
                               f"{len(prompt_ids)} prompts x n={sampling.n}")
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completions,
                            finish_reasons=reasons, sampler_logprobs=logps, weight_version=self.weight_version,
                            timings={"generate": time.perf_counter() - start}, metrics=self.router.take_metrics())

    def score(self, sequences: list[list[int]], images=None) -> list[list[float]]:
        parts = split_groups(len(sequences), len(self.urls), self._calls)
        urls = wire_images.encode(images)
        futures = [self._pool.submit(self._post, self.urls[s], "/score",
                                     {"sequences": sequences[sl]} | ({} if urls is None else {"images": urls[sl]}))
                   for s, sl in parts]
        out: list[list[float]] = []
        for (server, _), fut in zip(parts, futures, strict=True):
            res = fut.result()
            self._check_version(self.urls[server], res.get("weight_version"))
            out += res["logprobs"]
        return out

    def _post(self, url: str, path: str, body: dict) -> dict:
        return self.http.call(url, "POST", path, json=body,
                              verify_after_recovery=self._holds_our_weights).json()

    def _holds_our_weights(self, url: str) -> bool:
        try:
            info = self.http.request(url, "GET", "/info", timeout=10.0).json()
        except Exception:  # noqa: BLE001 - any failure means "cannot confirm": the caller re-syncs
            return False
        return info.get("weight_version") == self.weight_version and info.get("state") == "ready"

    def _check_version(self, url: str, version) -> None:
        if version != self.weight_version:  # it restarted (or another trainer pushed): our weights are gone
            self.router.forget(self.urls.index(url))
            raise RolloutServerDown(f"rollout server {url} answered with weights v{version}, but the trainer pushed "
                                    f"v{self.weight_version} (did it restart?): push the weights again "
                                    "(update_weights) and retry the step", url=url, recovered=True)

    # -- weight sync --------------------------------------------------------------------------------------
    @property
    def _nccl(self):
        """The NCCL sender while the servers are joined (`nccl` transport), else None."""
        return getattr(self._weights, "sender", None)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Through the weight transport to every server at once, then check each holds `version`. Not retried: a
        half-received update leaves the server refusing to generate until the next complete one, and the caller
        pushes again after RolloutServerDown(recovered=True)."""
        sent = self._weights.send(named_tensors, version, chunk_bytes=self.chunk_bytes)
        for url, res in zip(self.urls, sent.replies, strict=True):
            if res.get("weight_version") != version:
                raise RolloutError(f"rollout server {url} reports weights v{res.get('weight_version')} after "
                                   f"an update to v{version}")
        self.weight_version = version
        self.last_sync = {"seconds": sent.seconds, "bytes": sent.bytes}

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Ask every server to load a safetensors checkpoint (a file or a folder) it can read."""
        for url in self.urls:
            res = self.http.call(url, "POST", "/update_weights_from_disk", idempotent=False,
                                 json={"path": path, "version": version}).json()
            if res.get("weight_version") != version:
                raise RolloutError(f"rollout server {url} did not load {path} as v{version}: {res}")
        self.weight_version = version

    # -- memory and cache ---------------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        self.http.post_each(self.urls, "/sleep", json={"level": level})

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.http.post_each(self.urls, "/wake_up", json={"tags": tags})

    def reset_prefix_cache(self) -> None:
        self.http.post_each(self.urls, "/reset_prefix_cache")
