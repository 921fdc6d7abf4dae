"""Reward models: a local sequence-classification checkpoint (its own tokenizer and chat template, which may differ
from the policy's) scores prompt + completion at its last non-pad token, in batches, in the run's compute dtype on
the CPU or the training device (`reward_model`); a served one answers SGLang's /classify route
(`served_reward_model`)."""

from __future__ import annotations

import contextlib
import weakref
from functools import lru_cache

_HOMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A parked model's tensors, each with its host copy (`_homes`), kept as long as the model is."""


def resolve_rm_device(device: str):
    """`cpu`, a device name (the trainer passes its resolved device as one), or `auto` where no trainer resolved it
    (`grpo serve-rollout --task reward`): this process's CUDA device when there is one."""
    import torch

    from grpo_cli.runtime.accel import local_rank_from_env, resolve_device

    return resolve_device("auto", local_rank_from_env()) if device == "auto" else torch.device(device)


@lru_cache(maxsize=4)
def _load(path: str, dtype: str = "float32"):
    """The checkpoint in `dtype`, in host memory (`placed` puts it on its device), and its tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"
    return model, tokenizer


def _homes(net, device) -> list:
    """Each parameter and buffer of `net` with its host copy, made once per model and kept: page-locked when
    `device` is a GPU (`accel.pinned`), so each move there is one asynchronous copy. The model is frozen (it only
    scores), so the host copy stays current and parking needs no copy back."""
    from grpo_cli.runtime import accel

    homes = _HOMES.get(net) or [(t, t.detach().cpu()) for t in (*net.parameters(), *net.buffers())]
    _HOMES[net] = homes = [(t, accel.pinned(home, device)) for t, home in homes]  # pinned already: itself
    return homes


def _point(homes: list, device) -> None:
    """One move of the whole model: each tensor's storage becomes its host copy itself (the CPU: no copy) or one
    non-blocking copy of it on `device`, queued before the forward that reads it."""
    from grpo_cli.runtime import accel

    for tensor, home in homes:
        tensor.data = accel.to_device(home, device, non_blocking=True)


@contextlib.contextmanager
def placed(net, device, *, park: bool):
    """`net` on `device` while it scores; with `park` it waits in (pinned) host memory otherwise: one move there per
    block, one back (`_point`), its device blocks then handed back (`accel.empty_cache`) for the colocated rollout
    engine and the training state. Callers enter it once per scoring call, around all of its batches. One path on
    every device: on the CPU both moves leave every tensor where it is."""
    from grpo_cli.runtime import accel

    if not park:
        net.to(device)
        yield
        return
    homes = _homes(net, device)
    _point(homes, device)
    try:
        yield
    finally:
        _point(homes, "cpu")
        accel.empty_cache(device)


def _text(tokenizer, prompt: str, messages, completion: str) -> str:  # noqa: D103
    """The conversation in the reward model's own template when the prompt was chat messages (and the model has
    a template), else the policy's prompt text followed by the completion."""
    if isinstance(messages, list) and tokenizer.chat_template:
        return tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": completion}],
                                             tokenize=False)
    return prompt + completion


def score_texts(model: str, texts: list[str], *, batch_size: int, device: str = "cpu", dtype: str = "float32",
                park: bool = False) -> list[float]:
    """The checkpoint's single logit at each text's last non-pad token, right-padded batches of `batch_size`, on
    `device` (`resolve_rm_device`) in `dtype`; with `park` the model waits in host memory between calls."""
    import torch

    net, tokenizer = _load(model, dtype)
    out: list[float] = []
    with placed(net, resolve_rm_device(device), park=park), torch.no_grad():
        where = next(net.parameters()).device
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False)
            logits = net(input_ids=batch["input_ids"].to(where), attention_mask=batch["attention_mask"].to(where)
                         ).logits
            out += [float(x) for x in logits[:, 0]]
    return out


def reward_model(prompts, completions, *, model: str, batch_size: int = 16, device: str = "cpu",
                 dtype: str = "float32", park: bool = False, prompt_messages: list | None = None,
                 **_columns) -> list[float]:
    """Score r_j = head(h_j[last non-pad token]) of prompt j + completion j (the checkpoint's single logit), batches
    of `batch_size`, right-padded so a sequence's score does not depend on what it is batched with, on `device`
    (`cpu`, or `auto`: the training device) in `dtype`. In training, `rewards.resolve.reward_fns_for` passes the
    trainer's device for `auto`, the compute dtype `model.dtype` and `park` (`config.reward_models`). Written as a
    `rewards.functions` entry `{model: PATH}` (or `{name: reward_model, kwargs: {model: PATH}}`)."""
    _, tokenizer = _load(model, dtype)
    messages = prompt_messages or [None] * len(prompts)
    texts = [_text(tokenizer, p, m, c) for p, m, c in zip(prompts, messages, completions, strict=True)]
    return score_texts(model, texts, batch_size=batch_size, device=device, dtype=dtype, park=park)


def served_reward_model(prompts, completions, *, url: str, tokenizer: str | None = None, batch_size: int = 64,
                        retries: int = 3, timeout_s: float = 60.0, token_env: str = "GRPO_ROLLOUT_TOKEN",
                        prompt_messages: list | None = None, **_columns) -> list[float]:
    """Scores from a served reward model: POST `{url}/classify` with `{"text": [...]}` in batches, answered with
    one `{"embedding": [score, ...]}` per text, in order (SGLang's reward-model route,
    `python/sglang/srt/entrypoints/http_server.py`; also `grpo serve-rollout --task reward`). With `tokenizer` (a
    local folder of the reward model's tokenizer) chat prompts are rendered in its template, else prompt text +
    completion. A connection error, a timeout, a 429 or a 5xx is retried `retries` times (0.5 s, 1 s, 2 s …)."""
    import os

    import httpx

    from grpo_cli.rewards.http_retry import post_json

    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    messages = prompt_messages or [None] * len(prompts)
    texts = [_text(tok, p, m, c) if tok is not None else p + c
             for p, m, c in zip(prompts, messages, completions, strict=True)]
    headers = {"Authorization": f"Bearer {os.environ[token_env]}"} if os.environ.get(token_env) else {}
    out: list[float] = []
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        for start in range(0, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            resp = post_json(client, f"{url.rstrip('/')}/classify", {"text": chunk}, retries=retries)
            body = resp.json()
            if not isinstance(body, list) or len(body) != len(chunk):
                raise ValueError(f"{url}/classify answered {len(body) if isinstance(body, list) else body!r} "
                                 f"results for {len(chunk)} texts")
            out += [float(item["embedding"][0]) for item in body]
    return out
