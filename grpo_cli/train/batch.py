"""Turn a `RolloutBatch` into padded training tensors: [left-padded prompt | right-padded completion]."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

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

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Micro-batch of rows [start, stop)."""
        return replace(self, **{
            f.name: getattr(self, f.name)[start:stop] for f in fields(self) if getattr(self, f.name) is not None
        })

    def to(self, device: torch.device) -> TrainBatch:
        return replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in fields(self) if getattr(self, f.name) is not None
        })


def build_batch(rollout: RolloutBatch, *, group_size: int, pad_token_id: int) -> TrainBatch:
    """Completion j belongs to prompt j // group_size. Sampler logprobs are padded with 0 under the mask; a
    multi-turn rollout's environment tokens (`loss_masks` 0) are inside the sequence but outside the mask."""
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
    return TrainBatch(ids, attn, cmask, sampler_logprobs=sampler, truncated=truncated)


def forward_logprobs(model, mb: TrainBatch, *, temperature: float) -> torch.Tensor:
    """Completion-token logprobs (b, T) of a micro-batch, in fp32."""
    from grpo_cli.rollout.scoring import completion_logprobs

    return completion_logprobs(
        model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.num_completion_tokens, temperature=temperature
    ).float()


@torch.no_grad()
def batch_logprobs(model, batch: TrainBatch, *, micro_batch_size: int, temperature: float) -> torch.Tensor:
    """No-grad logprobs (B, T) of the whole batch, micro-batch by micro-batch (old-policy or reference pass)."""
    return torch.cat([forward_logprobs(model, batch.rows(i, i + micro_batch_size), temperature=temperature)
                      for i in range(0, len(batch), micro_batch_size)])
