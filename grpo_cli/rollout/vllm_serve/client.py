"""`rollout.engine: vllm-serve` (server mode): the trainer's client of one or more stock `vllm serve` servers
(vLLM 0.32, started by the user in dev mode with scale-out; the exact command is `server_facts.serve_command`).

- generation: token-in, token-out at `/inference/v1/generate`, one request per prompt (`n` samples, seed
  `seeds.request_seed(sampling.seed, rank, prompt index)`; vLLM gives child j that seed + j), the sampled tokens'
  processed logprobs (`--logprobs-mode processed_logprobs`, checked at connect) and the weight version of every
  sampled token (vLLM's `weight_versions` spans);
- the weight-sync probe: the same route with `prompt_logprobs: 0` at temperature 1 (`score`);
- weight sync: vLLM's RL API with the `grpo_shm` plugin engine (same host) or vLLM's `nccl` engine (`weights`,
  built through the transport registry as the `vllm-serve` client's `shm` and `nccl`);
  the version rides `/finish_weight_update` and is read back from `/weight_info`; with `verify`, `/weight_checker`
  checksums of every 1-D tensor the server holds under the trainer's name (norms; replicated under TP) are
  compared with SHA-256 of what was sent. The probe then runs in `train.weights.weight_sync.verify_sync`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from grpo_cli.rollout.base import RolloutBatch, RolloutError, SamplingParams
from grpo_cli.rollout.http_engine import HttpServerEngine
from grpo_cli.rollout.seeds import request_seed
from grpo_cli.rollout.vllm_serve.server_facts import ServerFacts, serve_command
from grpo_cli.rollout.transport import base as transports
from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown, split_groups

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


def checksum_names(checksums: dict[str, str]) -> dict[str, set[str]]:
    """`/weight_checker` checksums by parameter name (one digest per worker that holds it)."""
    out: dict[str, set[str]] = {}
    for key, digest in checksums.items():
        out.setdefault(key.split(":", CHECKSUM_PREFIX_PARTS)[-1], set()).add(digest)
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, as vLLM's `compute_tensor_digests` takes them."""
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


class VLLMServeEngine(HttpServerEngine):
    """RolloutEngine over stock `vllm serve` servers; groups stay whole on one server."""

    client = CLIENT
    thread_name_prefix = "vllm-serve"
    push_from_main_only = True
    """One push per job (`train.weights.sync_ranks`): rank 0 runs the update round on every server."""

    def __init__(self, urls: list[str], *, model: str, policy: Policy | None = None, token: str | None = None,
                 stop_token_ids: list[int] | None = None, chunk_mb: int = 128, transport: str = "shm",
                 verify: bool = True, connect: bool = True) -> None:
        transports.entry(transport, CLIENT)  # an unknown name is refused before any server is reached
        self._open(urls, token=token, policy=policy, transport=transport, workers=MAX_REQUESTS_IN_FLIGHT,
                   offered={"tp_size": lambda url: self.facts[url].tensor_parallel_size})
        self.model, self.transport, self.verify = model, transport, verify
        self.stop_token_ids = list(stop_token_ids or [])
        self.chunk_bytes = chunk_mb << 20
        self.facts: dict[str, ServerFacts] = {}
        self.dtype: str | None = None
        self.last_sync: dict[str, float] = {}
        self._held_names: set[str] | None = None
        if connect:
            self.connect()

    @classmethod
    def config_args(cls, cfg: GRPOConfig, ctx: EngineContext) -> dict:
        return {"model": ctx.model_path, "token": cfg.rollout.server.token, "transport": cfg.rollout.transport,
                "verify": cfg.rollout.vllm.verify_sync}

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
        self.dtype = next(iter(self.facts.values())).dtype
        versions = [self._server_version(url) for url in self.urls]
        self.weight_version = max((v for v in versions if v is not None), default=0)

    def _require_dev_mode(self, url: str, hint: str) -> None:
        if self.http.clients[url].get("/weight_info").status_code == 404:  # noqa: PLR2004
            raise RolloutError(f"vllm serve at {url} has no RL routes (/weight_info answers 404): it runs without "
                               f"VLLM_SERVER_DEV_MODE=1. Restart it so: `{hint}`")

    def _server_version(self, url: str, timeout: float | None = None) -> int | None:
        return parse_version(self.http.request(url, "GET", "/weight_info", timeout=timeout).json().get(
            "weight_version"))

    # -- generation --------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        start = time.perf_counter()
        params = {"n": sampling.n, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "top_k": sampling.top_k, "logprobs": 0, "detokenize": False,
                  "stop_token_ids": self.stop_token_ids}
        futures = []
        for url, index in self._placement(len(prompt_ids)):
            seed = None if sampling.seed is None else request_seed(sampling.seed, rank=self.rank, prompt=index)
            body = {"token_ids": list(prompt_ids[index]), "sampling_params": {**params, "seed": seed}}
            futures.append(self._pool.submit(self._post, url, body))
        completions, reasons, logps = [], [], []
        for fut in futures:
            url, out = fut.result()
            for choice in sorted(out["choices"], key=lambda c: c["index"]):
                self._check_version(url, choice.get("weight_versions"))
                ids = list(choice["token_ids"])
                content = (choice.get("logprobs") or {}).get("content") or []
                if len(content) != len(ids):
                    raise RolloutError(f"vllm serve at {url} returned {len(content)} logprobs for {len(ids)} tokens")
                completions.append(ids)
                reasons.append("stop" if choice.get("finish_reason") == "stop" else
                               (choice.get("finish_reason") or "length"))
                logps.append([float(c["logprob"]) for c in content])
        batch = RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completions,
                             finish_reasons=reasons, sampler_logprobs=logps, weight_version=self.weight_version,
                             timings={"generate": time.perf_counter() - start})
        if len(completions) == len(prompt_ids) * sampling.n:
            return batch
        raise RolloutError(f"vllm serve returned {len(completions)} completions for {len(prompt_ids)} prompts x "
                           f"n={sampling.n}")

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Temperature-1 prompt logprobs of each sequence (vLLM computes them from the raw logits)."""
        params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False, "seed": 0}
        futures = [self._pool.submit(self._post, url, {"token_ids": list(sequences[i]), "sampling_params": params})
                   for url, i in self._placement(len(sequences))]
        out = []
        for seq, fut in zip(sequences, futures, strict=True):
            url, res = fut.result()
            for choice in res["choices"]:
                self._check_version(url, choice.get("weight_versions"))
            rows = res.get("prompt_logprobs") or []
            out.append([float(rows[t][str(seq[t])]["logprob"]) for t in range(1, len(seq))])
        return out

    def _placement(self, count: int) -> Iterator[tuple[str, int]]:
        """(server, prompt index) for each prompt in order: contiguous slices round-robin over the servers."""
        parts = split_groups(count, len(self.urls), self._calls)
        self._calls += 1
        for server, sl in parts:
            for index in range(sl.start, sl.stop):
                yield self.urls[server], index

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
            raise RolloutServerDown(f"vllm serve at {url} sampled with weights {sorted(map(str, got))}, but the "
                                    f"trainer pushed v{self.weight_version} (did it restart?): push the weights "
                                    "again and retry the step", url=url, recovered=True)

    # -- weight sync --------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """One update round on every server, then (with `verify`) the version each reports and the checksums of
        the 1-D tensors sent under names the server holds. Not retried: a caller pushes again after
        RolloutServerDown(recovered=True)."""
        start = time.perf_counter()
        if self.verify and self._held_names is None:  # parameter names do not change: asked once
            self._held_names = set(self._checksums(self.urls[0]))
        held = self._held_names if self.verify else set()
        digests: dict[str, str] = {}

        def tapped() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in named_tensors:
                if name in held and t.dim() == 1:
                    digests[name] = tensor_digest(t)
                yield name, t

        sent = self._weights.send(tapped(), version, chunk_bytes=self.chunk_bytes)
        self.weight_version = version
        if self.verify:
            self._verify(version, digests)
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": sent.bytes}

    def _checksums(self, url: str) -> dict[str, set[str]]:
        res = self.http.call(url, "POST", "/weight_checker", json={"action": "checksum"}).json()
        return checksum_names(res.get("checksums") or {})

    def _verify(self, version: int, digests: dict[str, str]) -> None:
        for url in self.urls:
            got = self._server_version(url)
            if got != version:
                raise RolloutError(f"vllm serve at {url} reports weights v{got} after an update to v{version}")
            if not digests:
                continue
            held = self._checksums(url)
            wrong = sorted(n for n, d in digests.items() if held.get(n) != {d})
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
        self.http.post_each(self.urls, "/reset_prefix_cache")
