"""Selective activation checkpointing (`model.gradient_checkpointing: selective`) recomputes only elementwise ops:
the logprobs and every gradient equal those without checkpointing, and the policy really ran."""

from __future__ import annotations

import torch

from grpo_cli.models.logprobs import completion_logprobs
from grpo_cli.train.backends import activations


def _grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    lp = completion_logprobs(model, ids, mask, logits_to_keep=6, temperature=1.0)
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_selective_checkpointing_keeps_values_and_gradients(tiny_checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(0)
    ids, mask = torch.randint(6, 60, (6, 10), generator=g), torch.ones(6, 10, dtype=torch.long)
    mask[:, 8:] = torch.tensor([[1, 1], [0, 0], [1, 0], [1, 1], [0, 0], [1, 1]])
    ref = _grads(model, ids, mask)
    decisions = []
    real = activations._policy

    def counting(saved, ctx, op, *args, **kwargs):
        decisions.append(real(saved, ctx, op, *args, **kwargs))
        return decisions[-1]

    monkeypatch.setattr(activations, "_policy", counting)
    activations.enable_checkpointing(model, "selective")
    fast = _grads(model, ids, mask)
    from torch.utils.checkpoint import CheckpointPolicy

    assert CheckpointPolicy.MUST_SAVE in decisions and CheckpointPolicy.PREFER_RECOMPUTE in decisions
    assert torch.equal(fast[0], ref[0])
    for name, grad in ref[1].items():
        assert torch.allclose(fast[1][name], grad, atol=1e-7, rtol=1e-6), name
