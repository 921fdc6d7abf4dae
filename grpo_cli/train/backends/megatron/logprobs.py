"""Completion logprobs and entropy from Megatron's vocabulary-parallel logits, exactly as `rollout/scoring.py`
computes them from full logits: the log-sum-exp, the picked logit and Σ p·z are reduced across the tensor-parallel
ranks (each holds a slice of the vocabulary), in float32, from logits divided by the sampling temperature.

Rows arrive as [left-padded prompt | right-padded completion]; `right_aligned` moves each row's tokens to the front,
so positions 0..n−1 and a plain causal mask give every real token the context and position ids it has under the
Hugging Face forward (cumsum of the mask) — no per-row attention mask is needed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_cli.rollout.packing import completion_widths


@dataclass
class Aligned:
    """A micro-batch laid out for `GPTModel`: tokens (B, S) from position 0, the column of the logits predicting
    each completion token (B, T), the targets (B, T) and which completion positions count (B, T)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    predict_at: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor


def right_aligned(input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion: int) -> Aligned:
    """Shift each row left by its count of leading padding (its tokens wrap to the end, after every real token,
    where a causal mask keeps them out of the real tokens' context)."""
    batch, width = input_ids.shape
    lead = (attention_mask.cumsum(-1) == 0).sum(-1)  # leading zeros of every row
    cols = torch.arange(width, device=input_ids.device)
    tokens = input_ids.gather(1, (cols[None, :] + lead[:, None]) % width)
    completion_cols = cols[width - num_completion:][None, :] - lead[:, None]
    targets = input_ids[:, width - num_completion:]
    widths = completion_widths(attention_mask[:, width - num_completion:])
    valid = torch.arange(num_completion, device=input_ids.device)[None, :] < widths[:, None]
    return Aligned(tokens, cols[None, :].expand(batch, -1), (completion_cols - 1).clamp(min=0), targets, valid)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, temperature: float,
                            with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, T) of `targets` and the entropy (B, T) (None unless `with_entropy`) from this rank's vocabulary
    slice of the logits (B, T, V/tp), in float32. Columns past `vocab_size` (padding to a multiple of tp) are
    masked out. The sums cross ranks with `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity
    backward: every rank back-propagates the same loss once)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region as tp_sum,
    )

    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    local = z.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * local
    if start + local > vocab_size:
        pad = torch.arange(start, start + local, device=z.device) >= vocab_size
        z = z.masked_fill(pad, float("-inf"))
    top = z.detach().max(-1).values
    if mpu.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX,
                                     group=mpu.get_tensor_model_parallel_group())
    shifted = z - top.unsqueeze(-1)
    exp = shifted.exp()
    total = tp_sum(exp.sum(-1))
    lse = total.log()
    mine = (targets >= start) & (targets < start + local)
    picked = shifted.gather(-1, (targets - start).clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    logprobs = tp_sum(picked * mine) - lse
    if not with_entropy:
        return logprobs, None
    src_exp, src_shifted = (exp, shifted) if entropy_grad else (exp.detach(), shifted.detach())
    weighted = (src_exp * src_shifted.masked_fill(src_exp == 0, 0.0)).sum(-1)
    expected = tp_sum(weighted) / (total if entropy_grad else total.detach())
    entropy = (lse if entropy_grad else lse.detach()) - expected
    return logprobs, entropy
