"""Per-token logprobs of given sequences under a transformers causal LM (trainer and hf engine share it).

The batch is [left-padded prompt | right-padded completion]; the output layer runs a chunk of positions at a
time (`algo.chunked_logprobs`), so the (B, T, V) logits are never built whole. When the rows share prompts (the G
completions of a group) or carry much right padding, they run as packed rows (whenever that cuts the estimated cost
by `MIN_SAVING` and the model allows it: `_packable`): one copy of each prompt followed by its completions, a 4D mask
keeping completions apart — the same logits in one pass over fewer positions.
"""

from __future__ import annotations

import contextlib

import torch

from grpo_cli.algo.chunk_size import chunk_rows
from grpo_cli.algo.chunked_logprobs import chunked_logprobs
from grpo_cli.algo.entropy import token_entropy
from grpo_cli.models.attention import LAYOUT_ATTR
from grpo_cli.models.attention import NAME as ATTENTION
from grpo_cli.models.linear_fn import LINEAR_FN_ATTR
from grpo_cli.models.packing import attention_cost, completion_widths, packed_mask, plan_packing
from grpo_cli.models.vision import VisionInputs, dummy_tower, mrope_positions

MIN_SAVING = 0.1
"""Packing is used only when it cuts the estimated forward cost (`attention_cost`) by at least this share."""


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] without materialising the (…, V) log-prob tensor in fp32 at once.

    logprob = logit[id] − logsumexp(logits); computed row-chunk by row-chunk in fp32. Shapes (…, V), (…) → (…).
    """
    flat, flat_ids = logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)
    out = torch.empty(flat_ids.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], 1024):
        rows = flat[start : start + 1024].float()
        picked = rows.gather(-1, flat_ids[start : start + 1024, None]).squeeze(-1)
        out[start : start + 1024] = picked - torch.logsumexp(rows, dim=-1)
    return out.reshape(ids.shape)


def _packable(model) -> int | None:
    """Hidden size when `model` takes a custom 4D mask as its attention mask (eager/sdpa attention, no sliding-window
    layers, which would apply their own window), else None."""
    config = getattr(model, "module", model).config.get_text_config(decoder=True)
    if getattr(config, "_attn_implementation", None) not in ("eager", "sdpa", ATTENTION):
        return None
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return None
    return getattr(config, "hidden_size", None)


def packs_rows(model, vision: VisionInputs | None) -> bool:
    """Whether `completion_logprobs` may run this model's rows packed (a shared prompt once, no padding between
    completions): the model allows it (`_packable`) and the rows carry no images. Token-budget micro-batches are cut
    by the positions the forward runs (`train.batch.micro_batch_rows`)."""
    return vision is None and _packable(model) is not None


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of architectures whose forward changes the output layer's result (Gemma 2/3's soft cap, Cohere's
and Granite's scales): those keep the full-logits path."""


class ForwardStandIn:
    """A callable that replaces `layer.forward` on the instance inside `with` (restoring what the instance had, or
    the class's forward) so the model's own forward calls it; `project` is the layer's forward as it was (instance
    wrappers such as accelerate's hooks included). The chunked output layers of the trainer (`_HeadStats`) and of
    megatron (`VocabParallelHead`) are such stand-ins."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer, self.project, self._saved = layer, layer.forward, None

    def __enter__(self):
        self._saved = self.layer.__dict__.get("forward")
        self.layer.forward = self
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            del self.layer.forward
        else:
            self.layer.forward = self._saved


class _HeadStats(ForwardStandIn):
    """Stands in for the output layer's `forward` during one model call: from the hidden states it receives, the
    positions that predict completion tokens (`select`, set by the caller) go through `algo.chunked_logprobs` (on
    the layer's plain weight with its hand-written backward, else through the layer's own forward per chunk), and
    the call returns (B, T, k) = logprob (and entropy) in place of the logits. Running inside the model's forward keeps every backend's weight handling: FSDP2's root weights are
    unsharded there, ZeRO-3's hooks gather the layer's weight around the call and for its backward, a PEFT wrapper
    (`modules_to_save`, LoRA on the head) dispatches as usual, and tied embeddings are the same module's weight."""

    def __init__(self, layer: torch.nn.Module, targets: torch.Tensor, *, vocab: int, temperature: float,
                 with_entropy: bool, entropy_grad: bool) -> None:
        super().__init__(layer)
        self.targets, self.vocab, self.temperature = targets, vocab, temperature
        self.with_entropy, self.entropy_grad = with_entropy, entropy_grad
        self.select = None
        self.result: torch.Tensor | None = None

    @classmethod
    def install(cls, model, targets: torch.Tensor, **options) -> _HeadStats | None:
        """A stand-in for `model`'s output layer (not yet entered), or None when the model has none or transforms
        its logits after it."""
        hf = getattr(model, "module", model)
        config = hf.config.get_text_config(decoder=True)
        if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
            return None
        layer = hf.get_output_embeddings()
        if not isinstance(layer, torch.nn.Module):
            return None
        return cls(layer, targets, vocab=config.vocab_size, **options)

    def _plain_weight(self) -> torch.Tensor | None:
        """The layer's (V, H) weight when the layer is y = h Wᵀ on a tensor that is whole now and in backward (ddp,
        ZeRO-1/2, FSDP2 inside the root's forward, a ZeRO-3 partition: its module hooks gather it around this call
        and again before the backward of the call's output; tied or not): `chunked_logprobs`' hand-written backward,
        which sums a bf16 weight's gradient over the chunks in float32. None for anything else (a bias, a PEFT
        wrapper, another wrapper's forward; cpu_linear's is the same y = h Wᵀ), which the layer's own forward
        projects."""
        layer = self.layer
        if type(layer) is not torch.nn.Linear or layer.bias is not None:
            return None
        if self._saved is not None and getattr(layer, LINEAR_FN_ATTR, None) is None:
            return None
        weight = layer.weight
        return None if hasattr(weight, "placements") else weight

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.select(hidden)
        rows, cols, width = h.shape
        # the targets follow the hidden states (FSDP2's root forward moves its inputs to the mesh's device), and the
        # chunk is that device's (`algo.chunk_size`: larger on CUDA, where the head's backward is memory-bound)
        logprobs, entropy = chunked_logprobs(
            h.reshape(rows * cols, width), self.targets.to(h.device).reshape(-1), project=self.project,
            weight=self._plain_weight(), temperature=self.temperature,
            chunk=chunk_rows(self.vocab, device=h.device.type), with_entropy=self.with_entropy,
            entropy_grad=self.entropy_grad, shard=None)
        parts = [logprobs] if entropy is None else [logprobs, entropy]
        # a fresh tensor, not a view: FSDP2 hooks its pre-backward onto the root's outputs
        self.result = torch.stack([part.reshape(rows, cols) for part in parts], dim=-1)
        return self.result


def _packed_logits(model, input_ids, attention_mask, position_ids, prompt_len: int, hidden_size: int,
                   head: _HeadStats | None):
    """Logits (B, T, V) predicting each completion token from a packed forward pass (with `head`: its per-token
    statistics (B, T, k) instead), or None when packing would not cut the estimated cost by MIN_SAVING.

    With `grpo_sdpa` attention the batch runs as one row of every group in turn (`packed_attention` keeps each
    completion to its prompt and own tokens: work per token p + W, and no padding between groups), with logits
    only at the positions that predict a completion token; with `eager`/`sdpa` the row-wide masked attention grows
    with the row, so each row holds one prompt and is capped at max(S, hidden size) positions."""
    batch, width = input_ids.shape
    structured = getattr(model, "module", model).config._attn_implementation == ATTENTION
    packing = plan_packing(input_ids, attention_mask, prompt_len,
                           max_row=None if structured else max(width, hidden_size))
    rows, n = packing.src.shape
    packed_cost = attention_cost(rows, n, hidden_size=hidden_size, keys=width if structured else None)
    if packed_cost > (1 - MIN_SAVING) * attention_cost(batch, width, hidden_size=hidden_size):
        return None
    src = packing.src.clamp(min=0)
    valid = attention_mask.reshape(-1)[src] * (packing.src >= 0)
    if structured:
        from grpo_cli.models.packed_attention import build_layout

        mask = torch.ones((), dtype=torch.bool, device=src.device).expand(rows, 1, n, n)  # a shape, no N x N memory
        setattr(mask, LAYOUT_ATTR, build_layout(packing, valid))
        keep, at = torch.unique(packing.pos, return_inverse=True)  # the row's positions that predict a token
    else:
        mask = packed_mask(packing, valid)
        keep, at = n - prompt_len + 1, packing.pos - (prompt_len - 1)  # the last positions of every row
    dtype = next(model.parameters()).dtype
    if getattr(model, "module", model).config._attn_implementation == "eager":  # additive float mask
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    if head is not None:
        head.select = lambda hidden: hidden[packing.row[:, None], at]
    logits = model(input_ids=input_ids.reshape(-1)[src], attention_mask=mask,
                   position_ids=position_ids.reshape(-1)[src], use_cache=False, logits_to_keep=keep).logits
    return logits if head is not None else logits[packing.row[:, None], at]


def _completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int,
                       temperature: float, head: _HeadStats | None = None,
                       vision: VisionInputs | None = None) -> torch.Tensor:
    """Logits (B, T, V) / temperature predicting the last T = logits_to_keep tokens of `input_ids` (B, S); with
    `head` installed on the model's output layer, the statistics (B, T, k) it computes from the same positions.

    Position ids are (cumsum(mask) − 1) clamped at 0, as in generation. Rows run packed (`_packed_logits`) when the
    model allows it and it pays, else as one padded batch; both compute the same logits. With `vision` (a
    vision-language model's rows) the model also gets the rows' pixel patches and grids, positions are M-RoPE's
    (`vision.mrope_positions`, (3, B, S)), and rows are not packed; rows without an image run as text, with the
    tower on a zero-weight dummy image when the ranks agreed that another rank's micro-batch has one
    (`VisionInputs.dummy`).
    """
    prompt_len = input_ids.shape[1] - logits_to_keep
    if vision is not None and vision.num_images == 0:  # rows without images run as text (packed where it pays)
        with dummy_tower(model) if vision.dummy else contextlib.nullcontext():
            return _completion_logits(model, input_ids, attention_mask, logits_to_keep=logits_to_keep,
                                      temperature=temperature, head=head)
    extra = {}
    if vision is not None:
        position_ids = mrope_positions(model, input_ids, attention_mask, vision)
        extra = vision.model_kwargs()
    else:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden_size = _packable(model) if prompt_len > 0 and vision is None else None
    logits = None
    if hidden_size is not None:
        logits = _packed_logits(model, input_ids, attention_mask, position_ids, prompt_len, hidden_size, head)
    if logits is None:
        if head is not None:
            head.select = lambda hidden: hidden[:, :-1]
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=False, logits_to_keep=logits_to_keep + 1, **extra,
        ).logits
        if head is not None:
            return logits
        logits = logits[:, :-1]
    return logits / temperature if temperature != 1.0 and head is None else logits


def _valid_positions(attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """(B, T) bool: completion position t lies before the row's last unmasked position + 1."""
    widths = completion_widths(attention_mask[:, attention_mask.shape[1] - logits_to_keep :])
    return torch.arange(logits_to_keep, device=widths.device) < widths[:, None]


def _completion_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int,
                      temperature: float, with_entropy: bool, entropy_grad: bool, vision: VisionInputs | None):
    """(logprobs, entropy or None), each (B, T), through `algo.chunked_logprobs` inside the model's forward (the
    (B, T, V) logits never whole), or None for a model whose output layer cannot be stood in for."""
    head = _HeadStats.install(model, input_ids[:, input_ids.shape[1] - logits_to_keep :], temperature=temperature,
                              with_entropy=with_entropy, entropy_grad=entropy_grad)
    if head is None:
        return None
    with head:
        out = _completion_logits(model, input_ids, attention_mask, logits_to_keep=logits_to_keep,
                                 temperature=temperature, head=head, vision=vision)
    if head.result is None or out.shape != head.result.shape or not torch.equal(out, head.result):
        return None  # the model changed the output layer's result (a logit transform): the full-logits path
    return out[..., 0], (out[..., 1] if with_entropy else None)


def completion_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int, temperature: float,
    vision: VisionInputs | None = None,
) -> torch.Tensor:
    """Logprobs (B, T = logits_to_keep) of the last T tokens of `input_ids` (B, S), each given the tokens before it,
    from logits divided by `temperature` (matching the sampler's processed logprobs); 0 after a row's last
    unmasked position. The logits are built a chunk of positions at a time (`algo.chunked_logprobs`). `vision`:
    the rows' images (a vision-language model)."""
    stats = _completion_stats(model, input_ids, attention_mask, logits_to_keep=logits_to_keep,
                              temperature=temperature, with_entropy=False, entropy_grad=False, vision=vision)
    if stats is not None:
        logprobs = stats[0]
    else:
        logits = _completion_logits(model, input_ids, attention_mask, logits_to_keep=logits_to_keep,
                                    temperature=temperature, vision=vision)
        logprobs = selective_log_softmax(logits, input_ids[:, input_ids.shape[1] - logits_to_keep :])
    return logprobs * _valid_positions(attention_mask, logits_to_keep)


def completion_logprobs_entropy(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int, temperature: float,
    entropy_grad: bool, vision: VisionInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs` and the entropy (B, T) of the tempered policy at the same positions, from the same
    logits chunk (no second forward, no (B, T, V) buffer); 0 after a row's last unmasked position. The entropy
    carries a gradient only with `entropy_grad` (the entropy bonus)."""
    valid = _valid_positions(attention_mask, logits_to_keep)
    stats = _completion_stats(model, input_ids, attention_mask, logits_to_keep=logits_to_keep,
                              temperature=temperature, with_entropy=True, entropy_grad=entropy_grad, vision=vision)
    if stats is not None:
        entropy = stats[1] if entropy_grad else stats[1].detach()
        return stats[0] * valid, entropy * valid
    logits = _completion_logits(model, input_ids, attention_mask, logits_to_keep=logits_to_keep,
                                temperature=temperature, vision=vision)
    logprobs = selective_log_softmax(logits, input_ids[:, input_ids.shape[1] - logits_to_keep :])
    entropy = token_entropy(logits if entropy_grad else logits.detach())
    return logprobs * valid, entropy * valid


def right_padded(sequences: list[list[int]], *, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (N, longest): each sequence from column 0, `pad_token_id` after it."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def score_sequences(model, sequences: list[list[int]], *, pad_token_id: int,
                    vision: VisionInputs | None = None) -> list[list[float]]:
    """Raw (temperature 1) logprob of every token after the first of each sequence (right-padded batch); `vision`:
    the sequences' images, one row each (a vision-language model)."""
    device = next(model.parameters()).device
    ids, mask = right_padded(sequences, pad_token_id=pad_token_id)
    width = ids.shape[1]
    lp = completion_logprobs(model, ids.to(device), mask.to(device), logits_to_keep=width - 1, temperature=1.0,
                             vision=None if vision is None else vision.to(device))
    return [lp[i, : len(s) - 1].tolist() for i, s in enumerate(sequences)]
