"""Where a judge's prompts are answered: an OpenAI-compatible server (`/v1/chat/completions`), a `grpo
serve-rollout` server (`/generate`, token ids) or a local checkpoint (transformers' `generate`). Each takes judge
prompts and returns one answer per prompt, None where its request failed; a failure is counted, never raised."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from grpo_cli.config.judge import JudgeConfig, is_url

log = logging.getLogger(__name__)


@dataclass
class JudgeStats:
    """Counts since the last `pop` (thread-safe: requests run in a pool)."""

    requests: int = 0
    failed_requests: int = 0
    retries: int = 0
    latency_s: float = 0.0
    cache_hits: int = 0
    missing: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: float) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def pop(self, prefix: str) -> dict[str, float]:
        """`{prefix}/requests`, `failed_requests`, `retries`, `cache_hits`, `missing` (completions without a score)
        and `latency_s` (mean seconds per request, its retries and back-off included), then zeroed."""
        with self.lock:
            out = {f"{prefix}/{k}": float(getattr(self, k))
                   for k in ("requests", "failed_requests", "retries", "cache_hits", "missing")}
            out[f"{prefix}/latency_s"] = self.latency_s / self.requests if self.requests else 0.0
            self.requests = self.failed_requests = self.retries = self.cache_hits = self.missing = 0
            self.latency_s = 0.0
        return out


def _as_chat(tokenizer, text: str) -> str:
    """The judge prompt as one user turn in the judge's chat template (the generation prompt opened), or as it is
    when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


HINTS = {401: "is `token_env` the variable holding the server's key (vLLM's --api-key)?",
         403: "is `token_env` the variable holding the server's key (vLLM's --api-key)?",
         404: "is `api` right? a grpo serve-rollout judge is api: grpo"}
"""What a status usually means for a judge's settings, added to the warning."""


def _server_says(exc: Exception) -> str:
    """The server's own error message of an HTTP error (an OpenAI-compatible `{"error": {"message": ...}}`, or the
    body's text), and a hint for the status; empty for other exceptions."""
    resp = getattr(exc, "response", None)
    if resp is None:
        return ""
    try:
        body = resp.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        message = resp.text
    hint = f"; {HINTS[resp.status_code]}" if resp.status_code in HINTS else ""
    return f": the server says {str(message)[:300]!r}{hint}"


class Backend:
    """`answer(texts)`: one answer per judge prompt, in order, None where its request failed. Subclasses answer
    `batch_size` prompts per `_request` (`per_request`) or one per request, `batch_size` in flight (`pooled`)."""

    pooled = False

    def __init__(self, cfg: JudgeConfig, stats: JudgeStats) -> None:
        self.cfg, self.stats = cfg, stats

    def _request(self, texts: list[str]) -> list[str]:
        raise NotImplementedError

    def _counted(self, texts: list[str]) -> list[str | None]:
        """`_request(texts)` timed and counted; a failure (after its retries) is logged and scores None."""
        started = time.perf_counter()
        try:
            answers = self._request(texts)
            if len(answers) != len(texts) or not all(isinstance(a, str) for a in answers):
                raise ValueError(f"{len(answers)} answers for {len(texts)} prompts, or an answer that is not text")
        except Exception as exc:  # noqa: BLE001 - a failed request is a missing score, counted
            first = self.stats.failed_requests == 0  # warn once per step; the metric counts the rest
            self.stats.add(requests=1, failed_requests=1, latency_s=time.perf_counter() - started)
            if first:
                log.warning("judge %s: a request for %d prompt(s) failed (%s: %s)%s; they score missing, and so do "
                            "those of further failed requests this step (judge/<name>/failed_requests)",
                            self.cfg.judge, len(texts), type(exc).__name__, str(exc).splitlines()[0][:300],
                            _server_says(exc))
            return [None] * len(texts)
        self.stats.add(requests=1, latency_s=time.perf_counter() - started)
        return answers

    def answer(self, texts: list[str]) -> list[str | None]:
        size = 1 if self.pooled else self.cfg.batch_size
        chunks = [texts[i:i + size] for i in range(0, len(texts), size)]
        workers = min(self.cfg.batch_size, len(chunks)) if self.pooled else 1
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return [a for part in pool.map(self._counted, chunks) for a in part]


class _Http(Backend):
    def __init__(self, cfg: JudgeConfig, stats: JudgeStats) -> None:
        import httpx

        super().__init__(cfg, stats)
        token = os.environ.get(cfg.token_env) if cfg.token_env else None
        self.client = httpx.Client(timeout=cfg.timeout_s,
                                   headers={"Authorization": f"Bearer {token}"} if token else {})
        self.url = cfg.judge.rstrip("/")

    def _post(self, route: str, body: dict):
        from grpo_cli.rewards.http_retry import post_json

        return post_json(self.client, f"{self.url}{route}", body, retries=self.cfg.retries,
                         on_retry=partial(self.stats.add, retries=1)).json()


class OpenAIChat(_Http):
    """`POST {url}/v1/chat/completions` per judge prompt (one user message), `batch_size` requests in flight; the
    answer is `choices[0].message.content`."""

    pooled = True

    def _request(self, texts: list[str]) -> list[str]:
        body = {"messages": [{"role": "user", "content": texts[0]}], "max_tokens": self.cfg.max_tokens,
                "temperature": self.cfg.temperature, "n": 1}
        if self.cfg.model:
            body["model"] = self.cfg.model
        return [self._post("/v1/chat/completions", body)["choices"][0]["message"]["content"]]


class GrpoServer(_Http):
    """`POST {url}/generate` of a `grpo serve-rollout` server: batches of `batch_size` judge prompts as token ids of
    the judge's tokenizer (`tokenizer`, else the checkpoint the server's `/info` names), in its chat template;
    temperature 0 is top_k 1."""

    tokenizer = None

    def _tokenizer(self):
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            from grpo_cli.models.tiny import resolve_model_path

            name = self.cfg.tokenizer or self.client.get(f"{self.url}/info").raise_for_status().json()["model"]
            self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
        return self.tokenizer

    def _request(self, texts: list[str]) -> list[str]:
        tok, t = self._tokenizer(), self.cfg.temperature
        body = {"prompt_ids": [tok.encode(_as_chat(tok, text), add_special_tokens=False) for text in texts],
                "sampling": {"n": 1, "max_tokens": self.cfg.max_tokens, "temperature": t or 1.0,
                             "top_k": 0 if t else 1}}
        if tok.eos_token_id is not None:
            body["stop_token_ids"] = [tok.eos_token_id]
        return tok.batch_decode(self._post("/generate", body)["completion_ids"], skip_special_tokens=True)


class LocalCheckpoint(Backend):
    """A causal LM loaded once (at build time: a wrong path stops the run before training) in `cfg.dtype` (float32
    when unset) on `cfg.device`, answering batches of `batch_size` left-padded judge prompts with `generate`
    (greedy at temperature 0); with `park` it waits in host memory between calls (`rewards.model.placed`), moved to
    its device once per `answer`, not once per batch."""

    def __init__(self, cfg: JudgeConfig, stats: JudgeStats, *, park: bool = False) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo_cli.models.tiny import resolve_model_path
        from grpo_cli.rewards.model import resolve_rm_device

        super().__init__(cfg, stats)
        path = resolve_model_path(cfg.judge)
        self.device, self.park = resolve_rm_device(cfg.device), park
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = getattr(torch, cfg.dtype or "float32")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        if not park:
            self.model.to(self.device)

    def answer(self, texts: list[str]) -> list[str | None]:
        """All of `texts`' batches with the model placed once (a parked 7B judge moved per batch of 8 made 64 round
        trips for 512 completions); nothing to answer moves nothing."""
        from grpo_cli.rewards.model import placed

        if not texts:
            return []
        with placed(self.model, self.device, park=self.park):
            return super().answer(texts)

    def _request(self, texts: list[str]) -> list[str]:
        import torch

        tok, t = self.tokenizer, self.cfg.temperature
        batch = tok([_as_chat(tok, text) for text in texts], return_tensors="pt", padding=True,
                    add_special_tokens=False)
        with torch.no_grad():
            batch = batch.to(next(self.model.parameters()).device)
            out = self.model.generate(**batch, max_new_tokens=self.cfg.max_tokens, pad_token_id=tok.pad_token_id,
                                      **({"do_sample": True, "temperature": t} if t else {"do_sample": False}))
        return tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def make_backend(cfg: JudgeConfig, stats: JudgeStats, *, park: bool = False) -> Backend:
    """The judge's client: a URL by its `api`, anything else a local checkpoint (`park`: see `LocalCheckpoint`)."""
    if not is_url(cfg.judge):
        return LocalCheckpoint(cfg, stats, park=park)
    return OpenAIChat(cfg, stats) if cfg.api == "openai" else GrpoServer(cfg, stats)
