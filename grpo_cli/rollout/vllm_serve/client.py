"""`rollout.engine: vllm-serve` (server mode): the trainer's client of one or more stock `vllm serve` servers
(vLLM 0.32, started by the user in dev mode with scale-out; the exact command is `server_facts.serve_command`).

- generation: token-in, token-out at `/inference/v1/generate`, one request per prompt (`n` samples, seed
  `seeds.request_seed(sampling.seed, rank, prompt index)`; vLLM gives child j that seed + j), the sampled tokens'
  processed logprobs (`--logprobs-mode processed_logprobs`, checked at connect) and the weight version of every
  sampled token (vLLM's `weight_versions` spans);
- the weight-sync probe: the same route with `prompt_logprobs: 0` at temperature 1 (`score`);
- weight sync: vLLM's RL API with the `grpo_shm` plugin engine (same host) or vLLM's `nccl` engine
  (`transport/vllm_rl.py`, built through the transport registry as the `vllm-serve` client's `shm` and `nccl`);
  the version rides `/finish_weight_update` and is read back from `/weight_info`; with `verify`, `/weight_checker`
  checksums of every 1-D tensor the server holds under the trainer's name (norms; a tensor sharded under TP is
  compared piece by piece) are compared with SHA-256 of what was sent. The probe then runs in
  `train.weights.weight_sync.verify_sync`.
- nothing is sampled before this client's first full weight round has finished (nor after a failed one): the
  server may hold another run's weights, or a round a dead trainer left open (its layers on the meta device, where a
  generate kills vLLM's engine). `generate` then raises RolloutServerDown(recovered=True), on which the trainer
  pushes its weights and retries the step (`train.weights.sync_ranks.generate_with_resync`); the transport closes an
  open round first. The same holds for a generation vLLM aborted (`finish_reason: "abort"`, e.g. a `/pause`).
- stream mode (`streaming`): `generate_group` submits one prompt group for the trainer's pool
  (`train/stream_pool.py`) and reads each token's weight version from the spans; `update_weights` lands in flight
  (`/pause?mode=keep` → the round → `/resume`, `stream.py`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_cli.rollout.base import RolloutBatch, RolloutError, SamplingParams
from grpo_cli.rollout.http_engine import HttpServerEngine
from grpo_cli.rollout.seeds import request_seed
from grpo_cli.rollout.vllm_serve.server_facts import ServerFacts, serve_command
from grpo_cli.rollout.vllm_serve.stream import (ABORT, DeferredChecks, Group, InFlightUpdates, request_salt,
                                                token_versions)
from grpo_cli.rollout.transport import base as transports
from grpo_cli.rollout.transport.vllm_rl import reset_prefix_caches
from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown

if TYPE_CHECKING:
    import torch

    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.base import EngineContext

CLIENT = "vllm-serve"
"""This client's name in the weight-transport registry."""
GENERATE = "/inference/v1/generate"
CHECKSUM_PREFIX_PARTS = 4
"""`/weight_checker` keys are `dp0:pp0:pcp0:tp0:<parameter name>`."""
MAX_REQUESTS_IN_FLIGHT = 64


def parse_version(text) -> int | None:
    """vLLM's weight version label as our integer: the label we set (`"7"`), 0 for the checkpoint a fresh server
    loaded (`"default"`), None for anyone else's label."""
    if text == "default":
        return 0
    return int(text) if isinstance(text, str) and text.isdigit() else None


def checksum_names(checksums: dict[str, str]) -> dict[str, dict[int, set[str]]]:
    """`/weight_checker` checksums by parameter name, then by TP rank (one digest per worker that holds it)."""
    out: dict[str, dict[int, set[str]]] = {}
    for key, digest in checksums.items():
        *prefix, name = key.split(":", CHECKSUM_PREFIX_PARTS)
        tp = int(prefix[-1].removeprefix("tp")) if prefix and prefix[-1].startswith("tp") else 0
        out.setdefault(name, {}).setdefault(tp, set()).add(digest)
    return out


def read_choice(url: str, choice: dict) -> tuple[list[int], str, list[float]]:
    """One choice of vLLM's token-in/token-out reply: its token ids, finish reason and sampler logprobs (one per
    token, else a RolloutError)."""
    ids = list(choice["token_ids"])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise RolloutError(f"vllm serve at {url} returned {len(content)} logprobs for {len(ids)} tokens")
    return ids, finish_reason(url, choice), [float(c["logprob"]) for c in content]


def finish_reason(url: str, choice: dict) -> str:
    """A choice's finish reason as the batch records it ("stop" or "length"); an aborted one (a `/pause` or
    `/abort_requests` while it ran: its tokens are cut, maybe none) is never trained on: RolloutServerDown with
    `recovered`, so the trainer pushes its weights again (whoever paused the server may have changed them) and
    retries the step."""
    reason = choice.get("finish_reason")
    if reason == "abort":
        raise RolloutServerDown(f"vllm serve at {url} aborted a generation (finish_reason \"abort\": was it paused or "
                                "were its requests aborted?); retrying the step after a weight push", url=url,
                                recovered=True)
    return "stop" if reason in ("stop", "repetition") else "length"


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, as vLLM's `compute_tensor_digests` takes them."""
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@dataclass(frozen=True)
class TensorDigests:
    """What a server may hold of one sent 1-D tensor: all of it (replicated, e.g. a norm), or under TP size T its
    T equal pieces, TP rank k the k-th (a column-parallel bias: vLLM's `narrow(0, k·n/T, n/T)`)."""

    full: str
    pieces: tuple[str, ...] = ()

    @classmethod
    def of(cls, t: torch.Tensor, tp_size: int) -> TensorDigests:
        split = tp_size > 1 and t.numel() % tp_size == 0
        return cls(tensor_digest(t), tuple(tensor_digest(p) for p in t.chunk(tp_size)) if split else ())

    def matches(self, held: dict[int, set[str]]) -> bool:
        """`held`: TP rank → the digests the server's workers of that rank report (`checksum_names`)."""
        if all(d == {self.full} for d in held.values()):
            return True
        return bool(self.pieces) and all(k < len(self.pieces) and d == {self.pieces[k]} for k, d in held.items())


class VLLMServeEngine(HttpServerEngine):
    """RolloutEngine over stock `vllm serve` servers; groups stay whole on one server."""

    client = CLIENT
    thread_name_prefix = "vllm-serve"
    push_from_main_only = True
    """One push per job (`train.weights.sync_ranks`): rank 0 runs the update round on every server."""

    def __init__(self, urls: list[str], *, model: str, policy: Policy | None = None, token: str | None = None,
                 stop_token_ids: list[int] | None = None, chunk_mb: int = 128, transport: str = "shm",
                 verify: bool = True, connect: bool = True, streaming: bool = False, recompute_kv: bool = False
                 ) -> None:
        transports.entry(transport, CLIENT)  # an unknown name is refused before any server is reached
        self._open(urls, token=token, policy=policy, transport=transport, workers=MAX_REQUESTS_IN_FLIGHT,
                   offered={"world_size": self._world_size})
        self.model, self.transport, self.verify = model, transport, verify
        self.stop_token_ids = list(stop_token_ids or [])
        self.chunk_bytes = chunk_mb << 20
        self.facts: dict[str, ServerFacts] = {}
        self.dtype: str | None = None
        self.last_sync: dict[str, float] = {}
        self.synced = False
        """Whether a full weight round of this run has finished on every server since connecting (and none failed
        since): until then nothing is sampled."""
        self.streaming = streaming
        """Stream mode: weights land in flight (pause, round, resume) and every request has its own cache salt."""
        self.in_flight = InFlightUpdates(self.http, self.urls, self._pool, recompute_kv=recompute_kv)
        self.deferred = DeferredChecks()
        """Stream mode: a round's checks, run while the trainer trains on (`stream.DeferredChecks`)."""
        self.first_pushed: int | None = None
        """The first version this client pushed: a span's version outside first_pushed..weight_version is not ours."""
        if streaming:
            self._weights.routes.reset_prefix_cache = False
            self._weights.before_load = self.in_flight.pause  # requests kept; shm pauses after writing its file
        if connect:
            self.connect()

    @classmethod
    def config_args(cls, cfg: GRPOConfig, ctx: EngineContext) -> dict:
        return {"model": ctx.model_path, "token": cfg.rollout.server.token, "transport": cfg.rollout.transport,
                "verify": cfg.rollout.vllm.verify_sync, "streaming": cfg.rollout.mode == "stream",
                "recompute_kv": cfg.rollout.stream.recompute_kv}

    # -- start-up ---------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Wait (bounded) for every server's `/health`, then check its resolved config (`ServerFacts.check`) and
        read its weight version."""
        hint = serve_command(self.model, self.transport)
        self.http.wait_all_healthy(self.policy.connect_timeout_s, lambda url: hint)
        for url in self.urls:
            self._require_dev_mode(url, hint)
            resp = self.http.request(url, "GET", "/server_info", params={"config_format": "json"})
            self.facts[url] = ServerFacts.parse(resp.json())
            self.facts[url].check(url, self.transport, hint)
            self.check_served_length(url, self.facts[url].max_model_len, what="vllm serve", flag="--max-model-len")
        self.dtype = next(iter(self.facts.values())).dtype
        self.in_flight.release_paused()  # a killed streaming trainer's kept requests would queue ours forever
        self.weight_version = 0  # what a server holds is not adopted: the run pushes its own first (`synced`)

    def _require_dev_mode(self, url: str, hint: str) -> None:
        if self.http.clients[url].get("/weight_info").status_code == 404:  # noqa: PLR2004
            raise RolloutError(f"vllm serve at {url} has no RL routes (/weight_info answers 404): it runs without "
                               f"VLLM_SERVER_DEV_MODE=1. Restart it so: `{hint}`")

    def _world_size(self, url: str) -> int:
        """The server's workers, TP·PP·DP (vLLM's `GET /get_world_size`; NCCL's group holds every one)."""
        return int(self.http.request(url, "GET", "/get_world_size", params={"include_dp": "true"}).json()[
            "world_size"])

    def _server_version(self, url: str, timeout: float | None = None) -> int | None:
        return parse_version(self.http.request(url, "GET", "/weight_info", timeout=timeout).json().get(
            "weight_version"))

    # -- generation --------------------------------------------------------------------------------------
    def _require_synced(self) -> None:
        if not self.synced:
            raise RolloutServerDown(
                f"vllm serve at {self.urls[0]} does not hold this run's weights yet (a fresh connection, or the last "
                "weight round failed): push them, then retry the step", url=self.urls[0], recovered=True)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        start = time.perf_counter()
        self._require_synced()
        for facts in self.facts.values():
            facts.check_length(max(map(len, prompt_ids), default=0), sampling.max_tokens)
        params = self.sampling_body(sampling)
        futures = []
        for server, index in self._placement(len(prompt_ids), sampling.n):
            seed = None if sampling.seed is None else request_seed(sampling.seed, rank=self.rank, prompt=index)
            body = {"token_ids": list(prompt_ids[index]), "sampling_params": {**params, "seed": seed}}
            futures.append(self._pool.submit(self._routed, server, sampling.n, self._post, self.urls[server],
                                             self._salted(body)))
        completions, reasons, logps = [], [], []
        for fut in futures:
            url, out = fut.result()
            for choice in sorted(out["choices"], key=lambda c: c["index"]):
                self._check_version(url, choice.get("weight_versions"))
                ids, reason, lps = read_choice(url, choice)
                completions.append(ids)
                reasons.append(reason)
                logps.append(lps)
        batch = RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completions,
                             finish_reasons=reasons, sampler_logprobs=logps, weight_version=self.weight_version,
                             timings={"generate": time.perf_counter() - start},
                             metrics={**self.router.take_metrics(), **self._prefix_cache_metrics()})
        if len(completions) == len(prompt_ids) * sampling.n:
            return batch
        raise RolloutError(f"vllm serve returned {len(completions)} completions for {len(prompt_ids)} prompts x "
                           f"n={sampling.n}")

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Temperature-1 prompt logprobs of each sequence (vLLM computes them from the raw logits)."""
        self._require_synced()
        params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False, "seed": 0}
        futures = [self._pool.submit(self._routed, server, 1, self._post, self.urls[server],
                                     self._salted({"token_ids": list(sequences[i]), "sampling_params": params}))
                   for server, i in self._placement(len(sequences), 1)]
        out = []
        for seq, fut in zip(sequences, futures, strict=True):
            url, res = fut.result()
            for choice in res["choices"]:
                self._check_version(url, choice.get("weight_versions"))
            rows = res.get("prompt_logprobs") or []
            out.append([float(rows[t][str(seq[t])]["logprob"]) for t in range(1, len(seq))])
        return out

    def _salted(self, body: dict) -> dict:
        """Stream mode: the request's own `cache_salt` (no prefix-cache reset follows an in-flight update)."""
        return {**body, "cache_salt": request_salt()} if self.streaming else body

    def sampling_body(self, sampling: SamplingParams) -> dict:
        """vLLM's `sampling_params` for `sampling` (`generate` replaces the seed with each prompt's own)."""
        return {"n": sampling.n, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": sampling.top_k, "logprobs": 0, "detokenize": False,
                "stop_token_ids": self.stop_token_ids, "seed": sampling.seed}

    def generate_group(self, url: str, prompt_ids: list[int], sampling: SamplingParams, *, index: int,
                       request_id: str) -> Group:
        """Stream mode: one prompt group (`sampling.n` samples, `sampling.seed`) on `url`, blocking; each token's
        weight version from the server's spans. Called from the pool's threads (`train/stream_pool.py`)."""
        start, submitted = time.perf_counter(), self.weight_version
        if self.first_pushed is None:  # later, a group may start during a round: it queues on the paused server
            self._require_synced()
        self.facts[url].check_length(len(prompt_ids), sampling.max_tokens)
        body = {"token_ids": list(prompt_ids), "sampling_params": self.sampling_body(sampling),
                "request_id": request_id}
        _, out = self._post(url, self._salted(body))
        pushed = range(self.first_pushed if self.first_pushed is not None else submitted, self.weight_version + 1)
        group = Group(index, list(prompt_ids), [], [], [], [], submitted, url)
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            ids, reason, lps = read_choice(url, choice)
            group.token_versions.append(token_versions(url, choice.get("weight_versions"), len(ids), pushed=pushed))
            group.finish_reasons.append(reason)
            group.completion_ids.append(ids)
            group.sampler_logprobs.append(lps)
        if len(group.completion_ids) != sampling.n:
            raise RolloutError(f"vllm serve returned {len(group.completion_ids)} completions for n={sampling.n}")
        group.seconds = time.perf_counter() - start
        return group

    def abort(self, url: str, request_ids: list[str]) -> None:
        """Stream mode, at the end: vLLM's `/abort_requests` of the pool's requests (best effort: a server that is
        gone has nothing left to abort)."""
        try:
            self.http.request(url, "POST", ABORT, json={"request_ids": request_ids}, timeout=10.0)
        except Exception:  # noqa: BLE001 - the run is ending; the server may be gone
            pass

    def _placement(self, count: int, weight: int) -> Iterator[tuple[int, int]]:
        """(server, prompt index) for each prompt in order, by load or trajectory (`rollout/routing.py`)."""
        yield from ((server, index) for index, server in enumerate(self._place(count, weight)))

    def _post(self, url: str, body: dict) -> tuple[str, dict]:
        return url, self.http.call(url, "POST", GENERATE, json=body, verify_after_recovery=self._holds_our_weights
                                   ).json()

    def _holds_our_weights(self, url: str) -> bool:
        try:
            return self._server_version(url, timeout=10.0) == self.weight_version
        except Exception:  # noqa: BLE001 - any failure means "cannot confirm": the caller re-syncs
            return False

    def _check_version(self, url: str, spans: list[dict] | None) -> None:
        got = {parse_version(s.get("version")) for s in spans or []}
        if got and got != {self.weight_version}:  # it restarted (or another trainer pushed): our weights are gone
            self.router.forget(self.urls.index(url))
            raise RolloutServerDown(f"vllm serve at {url} sampled with weights {sorted(map(str, got))}, but the "
                                    f"trainer pushed v{self.weight_version} (did it restart?): push the weights "
                                    "again and retry the step", url=url, recovered=True)

    # -- weight sync --------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """One update round on every server, then (with `verify`) the version each reports and the checksums of
        the 1-D tensors sent under names the server holds (asked after the round: before it, the model may be on
        the meta device). Not retried: a caller pushes again after RolloutServerDown(recovered=True); until a round
        succeeds nothing is sampled (`synced`)."""
        start = time.perf_counter()
        digests: dict[str, TensorDigests] = {}

        def tapped() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in named_tensors:
                if self.verify and t.dim() == 1:
                    digests[name] = TensorDigests.of(t, max(f.tensor_parallel_size for f in self.facts.values()))
                yield name, t

        self.settle_checks()  # the last round's checks (stream mode) pass before this one begins
        self.synced = False  # stream mode: the transport pauses (`before_load`); a failed round leaves them paused
        sent = self._weights.send(tapped(), version, chunk_bytes=self.chunk_bytes)
        self.weight_version = version
        self.first_pushed = version if self.first_pushed is None else self.first_pushed
        self.synced = True
        if self.streaming:
            self.in_flight.resume()
        if self.verify and self.streaming:
            self.deferred.submit(lambda: self._verify(version, digests))
        elif self.verify:
            self._verify(version, digests)
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": sent.bytes}

    def probe_when_awake(self, check) -> bool:
        """Stream mode: the sync probe runs after the round's own checks on their thread (`DeferredChecks`), while
        the trainer trains on; False otherwise (and for the check itself): the caller probes now."""
        return self.streaming and self.deferred.defer(check)

    def settle_checks(self) -> dict[str, float]:
        return self.deferred.settle()

    def follow_update(self, version: int) -> None:
        """A rank that did not push: rank 0's round on every server succeeded (`sync_ranks`), so this rank samples."""
        self.weight_version = version
        self.synced = True

    def _checksums(self, url: str) -> dict[str, dict[int, set[str]]]:
        res = self.http.call(url, "POST", "/weight_checker", json={"action": "checksum"}).json()
        return checksum_names(res.get("checksums") or {})

    def _verify(self, version: int, digests: dict[str, TensorDigests]) -> None:
        for url in self.urls:
            got = self._server_version(url)
            if got != version:
                raise RolloutError(f"vllm serve at {url} reports weights v{got} after an update to v{version}")
            if not digests:
                continue
            held = self._checksums(url)
            digests = {n: d for n, d in digests.items() if n in held}
            wrong = sorted(n for n, d in digests.items() if not d.matches(held[n]))
            if wrong:
                raise RolloutError(
                    f"weight sync to v{version} did not take on vllm serve at {url}: /weight_checker's checksums of "
                    f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''} differ from what the trainer sent "
                    f"({len(digests) - len(wrong)} of {len(digests)} tensors match). Check that the server serves "
                    "the trainer's model (model.name_or_path).")

    # -- memory and cache ---------------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """A separate server keeps its memory (rollout.vllm.sleep_level is colocate-only)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing sleeps (see `sleep`)."""

    def reset_prefix_cache(self) -> None:
        reset_prefix_caches(self.http, self.urls)

    def close(self) -> None:
        self.deferred.close()
        super().close()
