"""Turn a `RolloutBatch` into padded training tensors: [left-padded prompt | right-padded completion]."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from grpo_cli.models.sequence_attention import SequenceShard
from grpo_cli.models.vision import VisionInputs
from grpo_cli.rollout.base import RolloutBatch


@dataclass
class TrainBatch:
    """B sequences. `input_ids`/`attention_mask` (B, S); completion tensors (B, T) are the last T positions."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    """(B,) bool: the completion hit the length cap (finish reason `length`)."""
    vision: VisionInputs | None = None
    """A vision-language model's rows: each row's images as the processor made them (row j has its prompt's);
    every micro-batch takes its own rows' (`rows`, `select`), and the forward passes them to the model."""

    def _tensors(self) -> dict:
        """The row tensors that are set (all but `vision`, which slices itself)."""
        return {f.name: v for f in fields(self) if f.name != "vision" and (v := getattr(self, f.name)) is not None}

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Micro-batch of rows [start, stop)."""
        vision = None if self.vision is None else self.vision.rows(start, stop)
        return replace(self, vision=vision, **{name: v[start:stop] for name, v in self._tensors().items()})

    def select(self, index: list[int]) -> TrainBatch:
        """Micro-batch of the rows `index` (in that order), cut to their own padding: the prompt columns that are
        padding in every selected row and the completion columns after the longest selected completion go (position
        ids are cumsum(mask) − 1, so the kept tokens' logits do not change)."""
        at = torch.tensor(index, dtype=torch.long, device=self.input_ids.device)
        vision = None if self.vision is None else self.vision.select(index)
        mb = replace(self, vision=vision, **{name: v[at] for name, v in self._tensors().items()})
        prompt_len, steps = mb.input_ids.shape[1] - mb.num_completion_tokens, mb.num_completion_tokens
        prompt, width = _row_lengths(mb.attention_mask, prompt_len)
        first, keep = prompt_len - int(prompt.max()), max(1, int(width.max()))
        cut = {name: v[:, :keep] for name, v in mb._tensors().items()
               if name not in ("input_ids", "attention_mask") and v.dim() == 2 and v.shape[1] == steps}
        return replace(mb, input_ids=mb.input_ids[:, first : prompt_len + keep],
                       attention_mask=mb.attention_mask[:, first : prompt_len + keep], **cut)

    def to(self, device: torch.device) -> TrainBatch:
        vision = None if self.vision is None else self.vision.to(device)
        return replace(self, vision=vision, **{name: v.to(device) for name, v in self._tensors().items()})


def row_vision(prompts_vision: list[VisionInputs | None], group_size: int, *, patch_dim: int) -> VisionInputs | None:
    """The batch's `vision`: completion j gets prompt j // group_size's images (none for a prompt without);
    None when no prompt has an image."""
    if all(v is None for v in prompts_vision):
        return None
    empty = VisionInputs.empty(1, patch_dim=patch_dim)
    per_prompt = VisionInputs.cat([empty if v is None else v for v in prompts_vision])
    return per_prompt.select([j // group_size for j in range(len(prompts_vision) * group_size)])


def build_batch(rollout: RolloutBatch, *, group_size: int, pad_token_id: int,
                vision: list[VisionInputs | None] | None = None) -> TrainBatch:
    """Completion j belongs to prompt j // group_size. Sampler logprobs are padded with 0 under the mask; a
    multi-turn rollout's environment tokens (`loss_masks` 0) are inside the sequence but outside the mask.
    `vision`: each prompt's processor outputs (a vision-language model), repeated over its completions."""
    comps = rollout.completion_ids
    prompts = [rollout.prompt_ids[j // group_size] for j in range(len(comps))]
    p_len, t_len = max(map(len, prompts)), max(1, max(map(len, comps)))
    b = len(comps)
    ids = torch.full((b, p_len + t_len), pad_token_id, dtype=torch.long)
    attn = torch.zeros((b, p_len + t_len), dtype=torch.long)
    cmask = torch.zeros((b, t_len), dtype=torch.float32)
    sampler = torch.zeros((b, t_len), dtype=torch.float32) if rollout.sampler_logprobs is not None else None
    for j, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        ids[j, p_len - len(p) : p_len] = torch.tensor(p)
        attn[j, p_len - len(p) : p_len + len(c)] = 1
        ids[j, p_len : p_len + len(c)] = torch.tensor(c, dtype=torch.long)
        cmask[j, : len(c)] = 1.0 if rollout.loss_masks is None else torch.tensor(rollout.loss_masks[j],
                                                                                 dtype=torch.float32)
        if sampler is not None:
            sampler[j, : len(c)] = torch.tensor(rollout.sampler_logprobs[j], dtype=torch.float32)
    truncated = torch.tensor([r == "length" for r in rollout.finish_reasons], dtype=torch.bool)
    rows_vision = None
    if vision is not None:
        dim = next((v.pixel_values.shape[1] for v in vision if v is not None), 0)
        rows_vision = row_vision(vision, group_size, patch_dim=dim)
    return TrainBatch(ids, attn, cmask, sampler_logprobs=sampler, truncated=truncated, vision=rows_vision)


def _row_lengths(attention_mask: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) prompt tokens (the left-padded prompt's unmasked positions) and completion widths of each row."""
    from grpo_cli.models.packing import completion_widths

    return attention_mask[:, :prompt_len].sum(dim=1), completion_widths(attention_mask[:, prompt_len:])


def token_groups(prompt: list[int], width: list[int], budget: int) -> list[list[int]]:
    """Rows grouped longest first so that each group's padded size — rows × (longest prompt + longest completion
    in it) — stays within `budget` positions; a row longer than the budget gets a group of its own. Sorting
    first keeps rows of like length together, so the padding left after `TrainBatch.select` is small. For rows
    that run padded (`models.logprobs.packs_rows` false: sliding-window layers, image rows)."""
    order = sorted(range(len(prompt)), key=lambda b: (-(prompt[b] + width[b]), b))
    groups: list[list[int]] = []
    top_p = top_w = 0
    for b in order:
        p, w = max(top_p, prompt[b]), max(top_w, max(1, width[b]))
        if groups and groups[-1] and (len(groups[-1]) + 1) * (p + w) <= budget:
            groups[-1].append(b)
            top_p, top_w = p, w
        else:
            groups.append([b])
            top_p, top_w = prompt[b], max(1, width[b])
    return groups


def packed_token_groups(prompt: list[int], width: list[int], groups: list[list[int]], budget: int) -> list[list[int]]:
    """Rows grouped so that each micro-batch's packed size — (prompts in it) × (its longest prompt) + Σ completion
    widths, the positions a packed forward runs (`models.packing`: one copy of each prompt, then its completions)
    — stays within `budget`. `groups`: the rows of each prompt group (`models.packing.prompt_groups`). A group goes
    whole into a micro-batch where it fits, so its prompt is computed once: the groups, costliest first, each into
    the first micro-batch with room (first-fit decreasing). A group larger than the budget is cut first, its rows
    longest first, into pieces that fit (each carries a copy of the prompt); a row longer than the budget is a piece
    of its own."""
    pieces: list[tuple[int, int, list[int]]] = []  # (prompt, Σ widths, rows); one group's rows each
    for rows in groups:
        piece, total = [], 0
        for b in sorted(rows, key=lambda b: (-width[b], b)):
            w = max(1, width[b])
            if piece and prompt[b] + total + w > budget:
                pieces.append((prompt[b], total, piece))
                piece, total = [], 0
            piece.append(b)
            total += w
        pieces.append((prompt[rows[0]], total, piece))
    bins: list[list] = []  # [prompt pieces, longest prompt, Σ widths, rows]
    for p, total, rows in sorted(pieces, key=lambda piece: (-(piece[0] + piece[1]), piece[2][0])):
        for slot in bins:
            if (slot[0] + 1) * max(slot[1], p) + slot[2] + total <= budget:
                slot[0], slot[1], slot[2] = slot[0] + 1, max(slot[1], p), slot[2] + total
                slot[3].extend(rows)
                break
        else:
            bins.append([1, p, total, list(rows)])
    return [slot[3] for slot in bins]


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` split until there are `count` of them (every rank must run the same number of micro-batches: each
    one's forward gathers sharded weights, its backward may reduce gradients): the group with the most rows is
    halved, its longer rows first, which keeps every group within the budget it was cut to."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[k]) < 2:
            raise ValueError(f"{sum(map(len, groups))} rows cannot make {count} micro-batches")
        half = len(groups[k]) // 2
        groups[k : k + 1] = [groups[k][:half], groups[k][half:]]
    return groups


def micro_batch_rows(batch: TrainBatch, *, micro_batch_size: int, micro_batch_tokens: int | None,
                     agree: Callable[[int], int] | None = None, packed: bool = False) -> list[list[int]]:
    """The rows of each micro-batch: consecutive runs of `micro_batch_size` rows, or with `micro_batch_tokens` the
    groups of that budget — `packed_token_groups` when the forward runs rows packed (`packed`:
    `models.logprobs.packs_rows`), else `token_groups` — split to `agree(count)` micro-batches (the ranks' largest
    count) when given."""
    if micro_batch_tokens is None:
        return [list(range(i, min(i + micro_batch_size, len(batch)))) for i in range(0, len(batch), micro_batch_size)]
    prompt_len = batch.input_ids.shape[1] - batch.num_completion_tokens
    prompt, width = (t.tolist() for t in _row_lengths(batch.attention_mask, prompt_len))
    if packed and prompt_len > 0:
        from grpo_cli.models.packing import prompt_groups

        groups = packed_token_groups(prompt, width, prompt_groups(batch.input_ids, batch.attention_mask, prompt_len),
                                     micro_batch_tokens)
    else:
        groups = token_groups(prompt, width, micro_batch_tokens)
    return split_to(groups, agree(len(groups))) if agree is not None else groups


def take(batch: TrainBatch, rows: list[int], *, micro_batch_tokens: int | None,
         any_images: Callable[[bool], bool] | None = None) -> TrainBatch:
    """Micro-batch `rows` of `batch`: a slice as cut by `micro_batch_size`, `select`ed (own padding only) under a
    token budget. Every pass's micro-batch comes from here. `any_images` (a vision-language model on several ranks:
    the backend's `agree_images`, a collective that every rank calls for every micro-batch) says whether any rank's
    micro-batch has an image; when one has and this one has none, it runs the tower on a dummy image
    (`VisionInputs.dummy`), so that the ranks' forwards and backwards issue the same collectives."""
    mb = batch.rows(rows[0], rows[-1] + 1) if micro_batch_tokens is None else batch.select(rows)
    if any_images is not None:
        has = mb.vision is not None and mb.vision.num_images > 0
        if any_images(has) and not has:
            mb = replace(mb, vision=VisionInputs.dummy_only(len(mb)))
    return mb


def scatter_rows(parts: list[torch.Tensor], groups: list[list[int]], steps: int) -> torch.Tensor:
    """(B, steps) from each micro-batch's (b, t ≤ steps) rows back in the batch's row order, 0 after column t."""
    first = parts[0]
    out = first.new_zeros((sum(map(len, groups)), steps))
    for part, rows in zip(parts, groups, strict=True):
        out[torch.tensor(rows, device=first.device), : part.shape[1]] = part
    return out


def forward_logprobs(model, mb: TrainBatch, *, temperature: float, shard: SequenceShard | None = None) -> torch.Tensor:
    """Completion-token logprobs (b, T) of a micro-batch, in fp32; with `shard`, the micro-batch cut across its
    sequence-parallel group (`models.sequence_logprobs`)."""
    if shard is not None:
        from grpo_cli.models.sequence_logprobs import sharded_logprobs_entropy

        return sharded_logprobs_entropy(model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.num_completion_tokens,
                                        temperature=temperature, with_entropy=False, entropy_grad=False,
                                        shard=shard)[0].float()
    from grpo_cli.models.logprobs import completion_logprobs

    return completion_logprobs(
        model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.num_completion_tokens, temperature=temperature,
        vision=mb.vision,
    ).float()


def forward_logprobs_entropy(model, mb: TrainBatch, *, temperature: float, entropy_grad: bool,
                             shard: SequenceShard | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion-token logprobs and entropy (b, T) of a training micro-batch (`forward_logprobs`' `shard`)."""
    if shard is not None:
        from grpo_cli.models.sequence_logprobs import sharded_logprobs_entropy

        return sharded_logprobs_entropy(model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.num_completion_tokens,
                                        temperature=temperature, with_entropy=True, entropy_grad=entropy_grad,
                                        shard=shard)
    from grpo_cli.models.logprobs import completion_logprobs_entropy

    return completion_logprobs_entropy(model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.num_completion_tokens,
                                       temperature=temperature, entropy_grad=entropy_grad, vision=mb.vision)


@torch.no_grad()
def batch_logprobs(model, batch: TrainBatch, *, micro_batch_size: int, temperature: float,
                   micro_batch_tokens: int | None = None, agree: Callable[[int], int] | None = None,
                   any_images: Callable[[bool], bool] | None = None,
                   shard: SequenceShard | None = None) -> torch.Tensor:
    """No-grad logprobs (B, T) of the whole batch, micro-batch by micro-batch (old-policy, reference or teacher
    pass); the micro-batches as `micro_batch_rows` cuts them and `take` takes them (`any_images`: see there), the
    result in the batch's row order; `shard`: see `forward_logprobs`."""
    from grpo_cli.models.logprobs import packs_rows

    groups = micro_batch_rows(batch, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                              agree=agree, packed=packs_rows(model, batch.vision))
    parts = [forward_logprobs(model, take(batch, rows, micro_batch_tokens=micro_batch_tokens, any_images=any_images),
                              temperature=temperature, shard=shard) for rows in groups]
    if micro_batch_tokens is None:
        return torch.cat(parts)
    return scatter_rows(parts, groups, batch.num_completion_tokens)
