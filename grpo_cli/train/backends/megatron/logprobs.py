"""Completion logprobs and entropy from Megatron's vocabulary-parallel logits, exactly as `models/logprobs.py`
computes them from full logits: the log-sum-exp, the picked logit and Σ p·z are reduced across the tensor-parallel
ranks (each holds a slice of the vocabulary), in float32, from logits divided by the sampling temperature.

Rows arrive as [left-padded prompt | right-padded completion]; `right_aligned` moves each row's tokens to the front,
so positions 0..n−1 and a plain causal mask give every real token the context and position ids it has under the
Hugging Face forward (cumsum of the mask) — no per-row attention mask is needed. `VocabParallelHead` computes them
inside the model's forward a chunk of positions at a time, so no rank holds the (B, S, V/tp) logits whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_cli.algo.chunk_size import chunk_rows
from grpo_cli.algo.chunked_logprobs import VocabShard, chunked_logprobs
from grpo_cli.models.packing import completion_widths
from grpo_cli.models.logprobs import ForwardStandIn
from grpo_cli.models.vocab_parallel import reduce_in


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


def _tensor_parallel_all_reduce(tensor: torch.Tensor, op: str) -> None:
    """All-reduce `tensor` in place ("max" or "sum") over this rank's tensor-parallel group (nothing at tp 1)."""
    from megatron.core import parallel_state as mpu

    if mpu.get_tensor_model_parallel_world_size() > 1:
        reduce_in(mpu.get_tensor_model_parallel_group(), tensor, op)


class VocabParallelHead(ForwardStandIn):
    """Stands in for `GPTModel.output_layer`'s forward during one micro-batch's forward: the hidden states at the
    columns predicting completion tokens go through the layer's weight (its own, or the tied embedding passed in) a
    chunk of positions at a time (`algo.chunk_size`'s chunk for the hidden states' device, over this rank's V/tp
    columns) in `algo.chunked_logprobs` with this rank's `VocabShard`: the log-sum-exp, picked logit and entropy
    all-reduced over the tensor-parallel group per chunk, the backward recomputing each chunk's logits (every rank
    the same chunks, so the all-reduces pair up), all-reducing ∂/∂h once (the layer's own input-gradient all-reduce)
    and summing the chunks' ∂/∂W in float32, cast to the bf16/fp16 parameter's dtype once. The model then returns
    (B, T, 2) = (logprob, entropy) instead of (B, S, V/tp) logits. Sequence parallelism (the layer gathers the
    sequence itself), multi-token prediction and a layer with a bias keep the full-logits path."""

    def __init__(self, layer: torch.nn.Module, aligned: Aligned, *, vocab_size: int, temperature: float,
                 with_entropy: bool, entropy_grad: bool) -> None:
        super().__init__(layer)
        self.aligned, self.vocab_size, self.temperature = aligned, vocab_size, temperature
        self.with_entropy, self.entropy_grad = with_entropy, entropy_grad

    @classmethod
    def install(cls, model: torch.nn.Module, aligned: Aligned, **options) -> VocabParallelHead | None:
        """A stand-in for the output layer of `model` (a Megatron chunk, possibly wrapped), or None on a stage without
        one or where the full-logits path stays."""
        for module in model.modules():
            layer = getattr(module, "output_layer", None)
            if layer is None or not getattr(module, "post_process", False):
                continue
            if (getattr(layer, "sequence_parallel", False) or getattr(module, "mtp_process", False)
                    or getattr(layer, "bias", None) is not None):
                return None
            return cls(layer, aligned, **options)
        return None

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        """hidden (S, B, H) → ((T, B, k), None), which `GPTModel` transposes to (B, T, k)."""
        from megatron.core import parallel_state as mpu

        rows_first = hidden.transpose(0, 1)
        at = self.aligned.predict_at.unsqueeze(-1).expand(-1, -1, rows_first.shape[-1])
        picked = rows_first.gather(1, at)  # (B, T, H)
        batch, width, size = picked.shape
        flat, targets = picked.reshape(batch * width, size), self.aligned.targets.reshape(-1)
        local = self.layer.output_size_per_partition
        shard = VocabShard(start=mpu.get_tensor_model_parallel_rank() * local, vocab=self.vocab_size,
                           all_reduce=_tensor_parallel_all_reduce)
        parts = chunked_logprobs(
            flat, targets, project=None, weight=self.layer.weight if weight is None else weight,
            temperature=self.temperature, chunk=chunk_rows(local, device=flat.device.type),
            with_entropy=self.with_entropy, entropy_grad=self.entropy_grad, shard=shard)
        stats = torch.stack([p.reshape(batch, width) for p in parts if p is not None], dim=-1)
        return stats.transpose(0, 1), None

    def split(self, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs, entropy or None), each (B, T), from what the model returned with this head installed."""
        return output[..., 0], (output[..., 1] if self.with_entropy else None)
