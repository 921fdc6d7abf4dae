"""Give every rank of a model-parallel group (tensor × pipeline) the same rows: the group's batches are gathered and
merged (prompts left-padded, completions right-padded to the widest), so each rank's rollouts are trained once per
data-parallel replica and the loss scaling of `compute_loss` (sum over micro-batches and ranks = step loss) holds."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from grpo_cli.train.batch import TrainBatch


@dataclass(frozen=True)
class RowSpan:
    """Where this rank's own rows sit in the merged batch: rows [start, stop), completion width `width`."""

    start: int
    stop: int
    width: int


def _widen(t: torch.Tensor, *, prompt_pad: int, completion_pad: int, sequence: bool) -> torch.Tensor:
    """Pad a (B, S) sequence tensor on both sides or a (B, T) completion tensor on the right; (B,) as is."""
    if t.ndim < 2:
        return t
    left = prompt_pad if sequence else 0
    return F.pad(t, (left, completion_pad), value=0)


def merge(batches: list[TrainBatch]) -> TrainBatch:
    """One batch of the rows of `batches` in order (same fields set on all)."""
    prompt = max(b.input_ids.shape[1] - b.num_completion_tokens for b in batches)
    completion = max(b.num_completion_tokens for b in batches)
    parts: dict[str, list[torch.Tensor]] = {}
    for b in batches:
        p_pad = prompt - (b.input_ids.shape[1] - b.num_completion_tokens)
        c_pad = completion - b.num_completion_tokens
        for f in fields(b):
            value = getattr(b, f.name)
            if value is not None:
                sequence = f.name in ("input_ids", "attention_mask")
                parts.setdefault(f.name, []).append(_widen(value, prompt_pad=p_pad, completion_pad=c_pad,
                                                           sequence=sequence))
    return replace(batches[0], **{name: torch.cat(ts) for name, ts in parts.items()})


def gather_group(batch: TrainBatch, group) -> tuple[TrainBatch, RowSpan]:
    """Collective over `group`: the merged batch of its ranks (on `batch`'s device) and this rank's rows in it."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return batch, RowSpan(0, len(batch), batch.num_completion_tokens)
    device = batch.input_ids.device
    cpu = replace(batch, **{f.name: getattr(batch, f.name).cpu() for f in fields(batch)
                            if getattr(batch, f.name) is not None})
    gathered: list = [None] * size
    torch.distributed.all_gather_object(gathered, cpu, group=group)
    rank = torch.distributed.get_rank(group)
    start = sum(len(b) for b in gathered[:rank])
    return merge(gathered).to(device), RowSpan(start, start + len(batch), batch.num_completion_tokens)
