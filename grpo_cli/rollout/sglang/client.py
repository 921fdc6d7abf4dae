"""`sglang` engine: a client of SGLang's native HTTP API (sglang >= 0.5.3; `/generate` with `return_logprob`,
`/update_weights_from_disk|tensor` inside `/begin_weight_update` … `/end_weight_update` from 0.5.21 on,
`/flush_cache`, `/release|resume_memory_occupation`, `/model_info`, `/server_info`), from SGLang's own source.

SGLang's returned logprobs are log_softmax(logits / temperature); top-p/top-k are not renormalised into them."""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_cli.rollout import images as wire_images
from grpo_cli.rollout.base import RolloutBatch, RolloutError, SamplingParams
from grpo_cli.rollout.http_engine import HttpServerEngine, model_identity
from grpo_cli.rollout.seeds import child_seed
from grpo_cli.rollout.sglang.vision import Placeholders
from grpo_cli.rollout.routing import runs
from grpo_cli.rollout.transport.http_client import Policy

if TYPE_CHECKING:
    import torch

    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.base import EngineContext

MIN_VERSION = (0, 5, 3)  # first with sampling_seed, release/resume tags, weight_version and deterministic inference
# Our wake tags -> SGLang's memory tags (`srt/constants.py`). Waking the KV cache wakes the CUDA graphs too (they
# replay on the KV pool); "cuda_graph" is a tag by 0.5.12, and 0.5.3 only records tags it does not act on.
WAKE_GROUPS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}


@dataclass(frozen=True)
class ServerFacts:
    """What `/server_info` reports about one SGLang server (its flags after SGLang resolved them)."""

    version: tuple[int, ...] | None
    tp_size: int
    deterministic: bool
    dp_size: int = 1
    """Data-parallel replicas (`--dp-size`)."""
    dp_attention: bool = False
    """`enable_dp_attention`: with it, older SGLang took tensor updates at dp_size > 1."""
    context_length: int | None = None
    """`--context-length` (None when not given: SGLang takes the model's); a request's prompt + max_new_tokens must
    stay below it."""


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """'0.5.21.post1' -> (0, 5, 21); None when there is no leading dotted number."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(g or 0) for g in m.groups()) if m else None


class SGLangEngine(HttpServerEngine):
    """RolloutEngine over one or more SGLang servers; groups stay whole on one server."""

    client = "sglang"
    thread_name_prefix = "sglang-http"
    push_from_main_only = True
    """One push per job (`train.weights.sync_ranks`): rank 0 alone writes the disk checkpoint or opens the weight-update
    session (a second rank's /begin_weight_update would close the first one's session)."""
    accepts_images = True
    """Images go in `/generate`'s `image_data` (PNG data URLs, one list per input, `srt/managers/io_struct.py`
    GenerateReqInput). SGLang decodes the ids and runs the HF processor on the text, so each image's run of
    `<|image_pad|>` goes as one pad (`vision.Placeholders.collapse`), which SGLang expands back to the trainer's
    ids; the image/video placeholders are banned with `logit_bias`, as the hf engine bans them."""

    def __init__(self, urls: list[str], *, policy: Policy | None = None, api_key: str | None = None,
                 stop_token_ids: list[int] | None = None, model_path: str | None = None,
                 weight_transport: str = "disk", weight_sync_dir: str | None = None,
                 chunk_mb: int = 512, serializer: Callable[[list], str] | None = None, connect: bool = True) -> None:
        offered = {"model_path": model_path, "sync_dir": weight_sync_dir, "serializer": serializer,
                   "tp_size": lambda url: self._facts(url).tp_size}
        self._open(urls, token=api_key, policy=policy, transport=weight_transport, offered=offered)
        self.stop_token_ids = list(stop_token_ids or [])
        self.model_path = model_path
        self.weight_transport = weight_transport
        self.chunk_bytes = chunk_mb << 20
        self.weights_released = False  # their memory comes back garbage: generate waits for a sync
        self.released: set[str] = set()  # SGLang memory tags this client released and did not resume yet
        self.facts: dict[str, ServerFacts] = {}
        self.placeholders = Placeholders.of(model_path)
        if connect:
            self.connect()

    @classmethod
    def config_args(cls, cfg: GRPOConfig, ctx: EngineContext) -> dict:
        s = cfg.rollout.server
        return {"api_key": s.token, "model_path": ctx.model_path, "weight_transport": cfg.rollout.transport,
                "weight_sync_dir": s.weight_sync_dir}

    def connect(self) -> None:
        hint = f"grpo serve-rollout --engine sglang --model {self.model_path or 'PATH'}"
        self.http.wait_all_healthy(self.policy.connect_timeout_s, lambda url: hint)
        want = model_identity(self.model_path).get("architectures") if self.model_path else None
        for url in self.urls:
            self.check_served_length(url, self._facts(url).context_length, what="SGLang server",
                                     flag="--context-length", exclusive=True)
            info = self.model_info(url)
            got = info.get("architectures")
            if want and got and list(want) != list(got):
                raise RolloutError(f"SGLang server {url} serves {info.get('model_path')!r} ({got}), the trainer's "
                                   f"model is {want}: start it with the trainer's model")

    def _get(self, url: str, path: str, old_path: str) -> dict:
        """GET `path`, or its older spelling `old_path` where the server answers 404."""
        try:
            return self.http.call(url, "GET", path).json()
        except RolloutError as e:
            if "answered 404" not in str(e):
                raise
            return self.http.call(url, "GET", old_path).json()

    def model_info(self, url: str) -> dict:
        return self._get(url, "/model_info", "/get_model_info")  # /model_info from sglang 0.5.2x

    def _facts(self, url: str) -> ServerFacts:
        if url not in self.facts:
            self.facts[url] = self.server_facts(url)
        return self.facts[url]

    def server_facts(self, url: str) -> ServerFacts:
        """Version, TP/DP sizes and `--enable-deterministic-inference` from `/server_info` (the resolved server
        args); refuses SGLang older than MIN_VERSION, and data-parallel replicas with the tensor transport, and
        warns when the server ignores sampling seeds."""
        info = self._get(url, "/server_info", "/get_server_info")
        version = parse_version(info.get("version"))
        if version is not None and version < MIN_VERSION:
            raise RolloutError(f"SGLang server {url} runs sglang {info.get('version')}; grpo-cli needs sglang >= "
                               f"{'.'.join(map(str, MIN_VERSION))} (per-request sampling seeds, memory tags, weight "
                               "versions): upgrade sglang on the server")
        facts = ServerFacts(version, int(info.get("tp_size") or 1), bool(info.get("enable_deterministic_inference")),
                            int(info.get("dp_size") or 1), bool(info.get("enable_dp_attention")),
                            info.get("context_length"))
        if self.weight_transport == "tensor" and facts.dp_size > 1 and not facts.dp_attention:
            # managers/tokenizer_control_mixin.py update_weights_from_tensor asserts dp_size == 1 (an HTTP 500)
            raise RolloutError(
                f"SGLang server {url} runs {facts.dp_size} data-parallel replicas (--dp-size {facts.dp_size}), and "
                "SGLang refuses weight updates from tensors on such a server (HTTP 500 at the first sync). Use "
                "rollout.server.weight_transport: disk, or start one SGLang server per replica with "
                "--dp-size 1 and list each in rollout.server.urls (groups are split over the servers).")
        if not facts.deterministic:
            warnings.warn(f"SGLang server {url} runs without --enable-deterministic-inference, so it ignores "
                          "sampling_seed: seeded rollouts are not reproducible (a resumed run samples other "
                          "completions). `grpo serve-rollout --engine sglang` turns it on.", RuntimeWarning,
                          stacklevel=3)
        return facts

    # -- generation -------------------------------------------------------------------------------------
    def _sampling(self, s: SamplingParams, seed: int | None) -> dict:
        params = {"max_new_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                  "top_k": s.top_k if s.top_k > 0 else -1, "n": 1, "skip_special_tokens": False,
                  "no_stop_trim": True}
        if self.stop_token_ids:
            params["stop_token_ids"] = self.stop_token_ids
        if seed is not None:
            params["sampling_seed"] = seed
        if self.placeholders.banned:
            params["logit_bias"] = self.placeholders.logit_bias()
        return params

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, images=None) -> RolloutBatch:
        """Each prompt is sent n times with n=1 (distinct seeds when seeded), so the order is ours; with `images`,
        its images go with each of those n inputs (SGLang aligns `image_data` with `input_ids` one to one)."""
        if self.weights_released:
            raise RolloutError("SGLang released its weights (sleep); push weights (update_weights) before "
                               "generating: after release/resume SGLang holds garbage, not the old weights")
        self.wake_up()
        start = time.perf_counter()
        parts = runs(self._place(len(prompt_ids), sampling.n))  # whole groups per server (rollout/routing.py)
        urls = wire_images.encode(images)
        futures = []
        for server, sl in parts:
            ids, params, image_data = [], [], []
            for i, prompt in enumerate(prompt_ids[sl], start=sl.start):
                for j in range(sampling.n):
                    ids.append(self.placeholders.collapse(prompt) if urls is not None else list(prompt))
                    seed = (None if sampling.seed is None else
                            child_seed(sampling.seed, rank=self.rank, prompt=i, child=j))
                    params.append(self._sampling(sampling, seed))
                    image_data.append(urls[i] if urls is not None else None)
            body = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1}
            if urls is not None:
                body["image_data"] = image_data
            futures.append(self._pool.submit(self._routed, server, len(ids), self._generate_call, self.urls[server],
                                             body))
        completions, reasons, logps = [], [], []
        for fut in futures:
            for out in fut.result():
                c, r, lp = _parse_output(out)
                completions.append(c)
                reasons.append(r)
                logps.append(lp)
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completions,
                            finish_reasons=reasons, sampler_logprobs=logps, weight_version=self.weight_version,
                            timings={"generate": time.perf_counter() - start}, metrics=self.router.take_metrics())

    def _generate_call(self, url: str, body: dict) -> list[dict]:
        out = self.http.call(url, "POST", "/generate", json=body).json()
        out = out if isinstance(out, list) else [out]
        if len(out) != len(body["input_ids"]):
            raise RolloutError(f"SGLang server {url} returned {len(out)} outputs for {len(body['input_ids'])} inputs")
        return out

    def score(self, sequences: list[list[int]], images=None) -> list[list[float]]:
        """Prompt logprobs of a 0-token generation (`logprob_start_len=0`); SGLang's first entry is None. With
        `images`: NaN at the placeholder positions, where SGLang scores another id (`Placeholders.unscored`)."""
        self.wake_up()
        sent = sequences if images is None else [self.placeholders.collapse(s) for s in sequences]
        body = {"input_ids": sent, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0}
        if images is not None:
            body["image_data"] = wire_images.encode(images)
        outs = self._generate_call(self.urls[0], body)
        result = []
        for seq, out in zip(sequences, outs, strict=True):
            entries = out["meta_info"]["input_token_logprobs"]
            if len(entries) != len(seq):
                raise RolloutError(f"SGLang returned {len(entries)} prompt logprobs for a {len(seq)}-token sequence")
            lps = [float(e[0]) for e in entries[1:]]
            result.append(lps if images is None else self.placeholders.unscored(seq, lps))
        return result

    # -- weight sync -------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Through the weight transport (`disk` or `tensor`), then check every server reports `version`."""
        self.wake_up(["weights"])
        sent = self._weights.send(named_tensors, version, chunk_bytes=self.chunk_bytes)
        for url in self.urls:
            got = self.model_info(url).get("weight_version")
            if got is not None and str(got) != str(version):
                raise RolloutError(f"SGLang server {url} reports weight_version {got!r} after an update to v{version}")
        self.weight_version = version
        self.weights_released = False
        self.last_sync = {"seconds": sent.seconds, "bytes": sent.bytes}

    # -- memory and cache --------------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Release GPU memory: level 0 the KV cache, level >= 1 also the weights (SGLang drops them, it does not
        offload them: generate refuses until a sync). Tags are explicit, so wake_up knows what is released."""
        tags = [t for group in (["kv_cache"] if level <= 0 else ["kv_cache", "weights"]) for t in WAKE_GROUPS[group]]
        tags = [t for t in tags if t not in self.released]
        if not tags:
            return
        self.http.post_each(self.urls, "/release_memory_occupation", json={"tags": tags})
        self.released |= set(tags)
        self.weights_released = self.weights_released or "weights" in tags

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Resume `tags` (default all) among those released: SGLang's resume removes each tag from its released
        set, and one never released raises KeyError in the scheduler (`weight_updater.py`), which then dies."""
        wanted = [t for group in (tags or list(WAKE_GROUPS)) for t in WAKE_GROUPS.get(group, (group,))]
        todo = [t for t in wanted if t in self.released]
        if not todo:
            return
        self.http.post_each(self.urls, "/resume_memory_occupation", json={"tags": todo})
        self.released -= set(todo)

    def reset_prefix_cache(self) -> None:
        self.http.post_each(self.urls, "/flush_cache")


def _parse_output(out: dict) -> tuple[list[int], str, list[float]]:
    meta = out.get("meta_info") or {}
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise RolloutError(f"SGLang aborted a request: {reason.get('message') if isinstance(reason, dict) else reason}")
    entries = meta.get("output_token_logprobs") or []
    ids = [int(e[1]) for e in entries] if entries else list(out.get("output_ids") or [])
    logps = [float(e[0]) for e in entries]
    if len(logps) != len(ids):
        raise RolloutError("SGLang returned no output_token_logprobs (was return_logprob dropped by a proxy?)")
    return ids, "stop" if kind == "stop" else "length", logps

