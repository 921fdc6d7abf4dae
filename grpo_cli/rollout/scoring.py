"""Per-token logprobs of given sequences under a transformers causal LM (trainer and hf engine share it)."""

from __future__ import annotations

import torch


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


def completion_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int, temperature: float
) -> torch.Tensor:
    """Logprobs (B, logits_to_keep) of the last `logits_to_keep` tokens of `input_ids` (B, S), each given the
    tokens before it, from logits divided by `temperature` (matching the sampler's processed logprobs)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        use_cache=False, logits_to_keep=logits_to_keep + 1,
    ).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    return selective_log_softmax(logits, input_ids[:, -logits_to_keep:])


@torch.no_grad()
def score_sequences(model, sequences: list[list[int]], *, pad_token_id: int) -> list[list[float]]:
    """Raw (temperature 1) logprob of every token after the first of each sequence (right-padded batch)."""
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    lp = completion_logprobs(model, ids.to(device), mask.to(device), logits_to_keep=width - 1, temperature=1.0)
    return [lp[i, : len(s) - 1].tolist() for i, s in enumerate(sequences)]
