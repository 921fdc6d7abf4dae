"""The hf engine's decode loop: prefill each prompt once, share its KV cache among its n samples, then decode one
token per step on a preallocated KV cache, dropping finished rows from the batch as they stop. With `keep`, each
row's KV is kept when it leaves the batch (`continuation.RowKV`), and `decode_continue` takes rows up again after
new tokens (a multi-turn rollout's next turn) without re-reading what they hold."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from grpo_cli.models.vision import VisionInputs, mrope_positions
from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.rollout.hf.continuation import KeptRows, RowKV, chunk_inputs, continuable, seed_cache, stash_rows
from grpo_cli.rollout.hf import lookahead
from grpo_cli.rollout.hf.decode_step import compiled_decode_sample, decode_sample, decoder_parts, plan_decode, preallocated
from grpo_cli.rollout.hf.sampling import process_logits, sample_tokens
from grpo_cli.rollout.hf.static_step import StaticStep, StepStore, bucket_size, weight_addresses
from grpo_cli.runtime.accel import is_cuda

COMPACT_FRACTION = 0.25
"""Drop finished rows from the batch (one copy of the KV cache) once they are at least this share of the active
rows: a finished row still costs a row of every matmul and attention call at each later step."""


@dataclass
class Decoded:
    """B = P·n rows, group-contiguous. `tokens`/`logprobs` (B, max_tokens) are valid up to `lengths` (B,) (the stop
    token included); `stopped` (B,) is True when the row sampled a stop token, False when it hit max_tokens."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    stopped: torch.Tensor
    kept: list[RowKV | None] | None = None  # with `keep`: each output row's KV (None: the cache cannot be kept)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids, attention_mask) of shape (N, max_len)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def supports_cache(model) -> bool:
    """Whether `model` takes a standard `Cache` object as `past_key_values` (not e.g. Mamba-style state)."""
    fn = getattr(model, "_supports_default_dynamic_cache", None)
    return bool(fn()) if fn is not None else False


def new_cache(model, *, max_len: int):
    """An empty KV cache for `model`: preallocated for `max_len` positions (static: written in place, no per-step
    concatenation) when the model's attention supports it and no autocast is on, else a growing dynamic cache."""
    from transformers import DynamicCache, StaticCache

    config = model.config.get_text_config(decoder=True)
    # Under autocast (bf16 compute over float32 weights) keys leave RoPE in float32 while values stay bf16; a
    # static cache takes one dtype from the first keys, so the growing cache is used there. The hf engine avoids
    # the case: it decodes a copy of the weights in autocast's dtype with autocast off (`hf.GenerationCopy`).
    autocast = torch.is_autocast_enabled(next(model.parameters()).device.type)
    if getattr(model, "_can_compile_fullgraph", False) and not autocast:
        return StaticCache(config=config, max_cache_len=max_len)
    return DynamicCache(config=config)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Replace every layer's keys/values by their batch rows `rows` (which may repeat rows), in place."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


class _Rows:
    """Per-row decode state of the active rows; `origin` maps each active row to its output row."""

    def __init__(self, origin: torch.Tensor, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        self.origin, self.mask, self.next_pos = origin, mask, next_pos
        self.done = torch.zeros(len(origin), dtype=torch.bool, device=origin.device)
        self.bias: torch.Tensor | None = None  # (B, 1, 1, S) additive mask of the lean decode step

    def keep(self, keep: torch.Tensor) -> None:
        self.origin, self.mask, self.next_pos, self.done = (
            t.index_select(0, keep) for t in (self.origin, self.mask, self.next_pos, self.done)
        )
        if self.bias is not None:
            self.bias = self.bias.index_select(0, keep)


def _prefill(model, prompt_ids: list[list[int]], n: int, steps: int, pad_token_id: int,
             vision: VisionInputs | None = None):
    """Run each prompt once into a new KV cache, then repeat its rows n times (cache, logits, masks, positions).
    With `vision` (one row per prompt) the prefill reads the images too, at M-RoPE positions (3, P, S); a row's
    generated tokens then continue on all three axes from its last prompt position + 1 (Qwen2-VL's rope delta is
    that position + 1 − the prompt's length)."""
    device = next(model.parameters()).device
    if not supports_cache(model):
        raise RolloutError(f"{type(model).__name__} has no standard KV cache; use rollout.engine: vllm for it")
    ids, mask = (t.to(device) for t in left_pad(prompt_ids, pad_token_id))
    cache = new_cache(model, max_len=ids.shape[1] + steps)
    if vision is None:
        pos, extra = (mask.cumsum(-1) - 1).clamp(min=0), {}
        last = pos[:, -1]
    else:
        vision = vision.to(device)
        pos, extra = mrope_positions(model, ids, mask, vision), vision.model_kwargs()
        last = pos[:, :, -1].max(dim=0).values
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                   logits_to_keep=1, **extra).logits[:, -1]
    expand = torch.arange(len(prompt_ids), device=device).repeat_interleave(n)
    select_rows(cache, expand)
    full_mask = torch.cat([mask, mask.new_ones((len(prompt_ids), steps))], dim=1).index_select(0, expand)
    rows = _Rows(torch.arange(len(expand), device=device), full_mask, last.index_select(0, expand) + 1)
    return cache, logits.index_select(0, expand), rows, ids.shape[1]


def _continue_prefill(model, kept: list[RowKV], new_ids: list[list[int]], steps: int, pad_token_id: int):
    """A new cache seeded with the rows' kept KV, then one forward over their continuation chunks
    (`continuation.chunk_inputs`); the same (cache, logits, rows, width) as `_prefill`."""
    device = next(model.parameters()).device
    layout = KeptRows(kept)
    ids, pos, mask, s0 = chunk_inputs(kept, layout, new_ids, steps, pad_token_id, device)
    width = s0 + ids.shape[1]
    cache = new_cache(model, max_len=width + steps)
    seed_cache(cache, layout)
    logits = model(input_ids=ids, attention_mask=mask[:, :width], position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    return cache, logits, _Rows(torch.arange(len(kept), device=device), mask, pos[:, -1] + 1), width


def _record(out: Decoded, rows: _Rows, t: int, tokens: torch.Tensor, logprobs: torch.Tensor,
            stop_ids: torch.Tensor) -> None:
    """Write step t's (tokens, logprobs) of the active rows into their output rows; a row not yet done whose token
    is a stop token gets length t + 1 and `stopped`, and is done. Index copies and `where` on the active rows, no
    boolean-mask indexing: nothing here makes the host wait for the device."""
    origin = rows.origin
    out.tokens[:, t].index_copy_(0, origin, tokens)
    out.logprobs[:, t].index_copy_(0, origin, logprobs)
    stop = torch.isin(tokens, stop_ids) & ~rows.done
    out.lengths.index_copy_(0, origin, torch.where(stop, t + 1, out.lengths.index_select(0, origin)))
    out.stopped.index_copy_(0, origin, out.stopped.index_select(0, origin) | stop)
    rows.done |= stop


def _stash(kept: list | None, cache, rows: _Rows, which: torch.Tensor, out: Decoded, width: int) -> None:
    """Keep the KV of active rows `which` (their output rows' lengths say how many generated slots are theirs)."""
    if kept is None or len(which) == 0:
        return
    origin = rows.origin.index_select(0, which)
    lengths = out.lengths.index_select(0, origin)
    last = out.tokens[origin, lengths - 1]
    for o, row in zip(origin.tolist(), stash_rows(cache, which.tolist(), rows.mask, width, lengths.tolist(),
                                                    last.tolist()), strict=True):
        kept[o] = row


def step_bias(mask: torch.Tensor, width: int) -> torch.Tensor:
    """(B, 1, 1, S) float32 additive attention mask for the lean decode step from the rows' (B, S) mask: 0 on
    prompt tokens, −inf on prompt padding and on the generated slots [width, S), which step t opens (slot
    width + t) just before it writes there."""
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(mask == 0, float("-inf"))
    bias[:, width:] = float("-inf")
    return bias[:, None, None, :]


def _mark_dynamic(plan, keys, values, tokens, positions, slot, bias, noise) -> None:
    """Mark the sizes that differ between calls of the compiled step as dynamic, so that one compile serves them
    all: the batch (finished rows are dropped as the decode goes) and the cache length (prompt width + max tokens,
    which changes with each batch of prompts)."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (*keys, *values):
        mark(t, 0)
        mark(t, 2)
    for t in (tokens, positions, bias, noise):
        mark(t, 0)
    mark(bias, 3)
    mark(plan.cos, 0)
    mark(plan.signed_sin, 0)


@torch.no_grad()
def decode(model, prompt_ids: list[list[int]], sampling: SamplingParams, *, eos_token_ids: list[int],
           pad_token_id: int, compile_step: bool = False, keep: bool = False, vision: VisionInputs | None = None,
           banned: list[int] | None = None, steps_store: StepStore | None = None) -> Decoded:
    """Sample `sampling.n` completions of each prompt (group-contiguous rows) with `model` in its current mode.

    Positions follow transformers' `generate` for left padding: position = (cumsum(mask) − 1), 0 on padding, and
    generated token t of a row sits at its prompt length + t. Decode steps of Llama-family models run
    `decode_step.decode_sample` (the same modules and math without transformers' per-call machinery, and the draw;
    under `torch.compile` with `compile_step`), others the model's forward. Each step's token is drawn from
    `process_logits` of the fp32 logits and its logprob recorded (`sample_tokens`); a row stops after a stop token.
    The lean step runs at static shapes (`static_step.StaticStep`: rows padded to a bucket, CUDA graphs on CUDA);
    `steps_store` (an engine's) keeps the captured graphs for its next decode of the same shape.
    Without a seed, the generator's seed is drawn from torch's global RNG.
    With `keep`, `Decoded.kept` holds each row's KV for `decode_continue`. `vision`: the prompts' images (one row
    per prompt; a vision-language model, which decodes through its full forward); `banned`: token ids never
    sampled (their logits set to −inf before processing: a VLM's image/video placeholders).
    """
    if vision is not None and keep:
        raise RolloutError("the hf engine keeps no KV for prompts with images (multi-turn rollouts of a "
                           "vision-language model are not supported)")
    prefilled = _prefill(model, prompt_ids, sampling.n, sampling.max_tokens, pad_token_id, vision)
    return _sample(model, *prefilled, sampling, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                   compile_step=compile_step, keep=keep, banned=banned, steps_store=steps_store)


@torch.no_grad()
def decode_continue(model, kept: list[RowKV], new_ids: list[list[int]], sampling: SamplingParams, *,
                    eos_token_ids: list[int], pad_token_id: int, compile_step: bool = False,
                    steps_store: StepStore | None = None) -> Decoded:
    """Continue rows whose KV was kept (`decode(keep=True)`), after `new_ids[j]` more tokens for row j: one
    completion per row (`sampling.n` is ignored), drawn as `decode` draws; the rows' KV is kept again."""
    prefilled = _continue_prefill(model, kept, new_ids, sampling.max_tokens, pad_token_id)
    return _sample(model, *prefilled, sampling, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                   compile_step=compile_step, keep=True, steps_store=steps_store)


def _sample(model, cache, logits, rows: _Rows, width: int, sampling: SamplingParams, *, eos_token_ids: list[int],
            pad_token_id: int, compile_step: bool, keep: bool, banned: list[int] | None = None,
            steps_store: StepStore | None = None) -> Decoded:
    """The decode loop from the prefilled state: one token per step for every active row until each stops.

    After step t the loop stops when every active row is done (or t is the last step) and drops the finished rows
    once they are ≥ `COMPACT_FRACTION` of the active rows; both need the finished count, the one value the host
    reads from the device per step (`lookahead.FinishedCount`). Where the lean step `runs_ahead` (CUDA), step t + 1
    is launched before that count is read when dropping rows after step t is unlikely (`launch_first`): when rows
    are dropped after all, the generator is set back to its state before step t + 1 and the step runs again on the
    kept rows, so the noise, tokens, logprobs and lengths are those of reading the count first.
    The count is not read only every K steps instead: dropping rows later would change which noise each row draws
    (`torch.rand((active rows, V))` per step), hence the sampled tokens for a seed."""
    steps = sampling.max_tokens
    device, batch = logits.device, len(rows.origin)
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed if sampling.seed is not None else int(torch.randint(2**62, ())))
    out = Decoded(torch.full((batch, steps), pad_token_id, dtype=torch.long, device=device),
                  torch.zeros((batch, steps), dtype=torch.float32, device=device),
                  torch.full((batch,), steps, dtype=torch.long, device=device),
                  torch.zeros(batch, dtype=torch.bool, device=device))
    stop_ids = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
    kept: list | None = [None] * batch if keep and continuable(cache) else None
    parts = decoder_parts(model) if preallocated(cache, width + steps) and not banned else None
    knobs = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    ban = torch.tensor(banned or [], dtype=torch.long, device=device)

    def draw(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(ban):
            logits = logits.index_fill(-1, ban, float("-inf"))
        return sample_tokens(process_logits(logits, **knobs), generator)

    static = None
    if parts is not None:
        rows.bias = step_bias(rows.mask, width)
        static, held = _static_step(model, parts, cache, width + steps, logits.shape[-1], knobs, compile_step,
                                    steps_store)

    def advance(feed: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch step t: the active rows' tokens `feed` (token t, pad where done) at slot width + t → token t + 1."""
        if static is not None:  # Llama-family model on a preallocated cache: the lean one-token forward and draw
            rows.bias[..., width + t] = 0.0
            return static(feed, rows.next_pos, width + t, rows.bias, generator)
        logits = model(input_ids=feed[:, None], attention_mask=rows.mask[:, : width + t + 1],
                       position_ids=rows.next_pos[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        return draw(logits)

    ahead = static is not None and lookahead.runs_ahead(device)
    finished_count = lookahead.FinishedCount(device)
    tokens, logprobs = draw(logits)
    for t in range(steps):
        _record(out, rows, t, tokens, logprobs, stop_ids)
        if t == steps - 1:
            _stash(kept, cache, rows, torch.arange(len(rows.origin), device=device), out, width)
            break
        feed = tokens.masked_fill(rows.done, pad_token_id)
        finished_count.put(rows.done)
        threshold = max(1.0, COMPACT_FRACTION * len(rows.origin))
        first = ahead and finished_count.launch_first(len(rows.origin), threshold)
        state = generator.get_state() if first else None
        launched = advance(feed, t) if first else None  # speculates that no row is dropped after step t
        finished = finished_count.read(len(rows.origin))
        if finished == len(rows.origin):
            _stash(kept, cache, rows, torch.arange(len(rows.origin), device=device), out, width)
            break
        if finished >= threshold:
            order = torch.argsort(rows.done.to(torch.uint8), stable=True)  # active rows, then finished ones
            active = order[: len(rows.origin) - finished]
            _stash(kept, cache, rows, order[len(rows.origin) - finished :], out, width)
            if static is not None:
                static.compact(active)  # in place, into the next smaller bucket
            else:
                select_rows(cache, active)
            rows.keep(active)
            finished_count.dropped()
            feed = feed.index_select(0, active)
            if launched is not None:  # the speculated step drew noise for the old rows: draw again from before it
                generator.set_state(state)
                launched = None
        tokens, logprobs = launched if launched is not None else advance(feed, t)
        rows.next_pos += 1
    out.kept = kept
    if static is not None and steps_store is not None and kept is None:  # kept rows are views of its buffers
        steps_store.put(*held, static)
    return out


def _static_step(model, parts, cache, slots: int, vocab: int, knobs: dict, compile_step: bool,
                 store: StepStore | None) -> tuple[StaticStep, tuple]:
    """The decode's `StaticStep` (from `store` when the last decode kept one of this shape over these weights),
    and the (key, weights) it is kept under. The slot is a tensor where the step is compiled or captured (CUDA)."""
    keys = cache.layers[0].keys
    tensor_slot = compile_step or is_cuda(keys.device)
    key = (bucket_size(keys.shape[0]), len(cache.layers), tuple(keys.shape[1:]), keys.dtype, str(keys.device), slots,
           vocab, tuple(knobs.items()), compile_step, tensor_slot)

    def build() -> StaticStep:
        lean_step = functools.partial(compiled_decode_sample() if compile_step else decode_sample, **knobs)
        return StaticStep(lean_step, plan_decode(parts, max_positions=slots), cache, vocab=vocab,
                          tensor_slot=tensor_slot, prepare=_mark_dynamic if compile_step else None)

    if store is None:
        return build(), (key, None)
    weights = weight_addresses(model)
    return store.take(key, weights, cache, build), (key, weights)
