"""The chunked output layer on CUDA (`models.logprobs._HeadStats` over `algo.chunked_logprobs`): at Qwen's vocabulary
an 8,192-position micro-batch runs in 5 chunks (the CUDA chunk, 2^28 logits), its bf16 gradients equal a plain
float32 full-logits computation to bf16 accuracy; and a frozen head (LoRA's `all-linear`) allocates no (V, H)
gradient in backward. Needs torch and grpo_cli alone (no transformers model, no vLLM)."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE, ON_CPU

from grpo_cli.algo import chunked_logprobs as chunked
from grpo_cli.algo.chunk_size import chunk_rows
from grpo_cli.models.logprobs import _HeadStats

QWEN_VOCAB = 151_936
# the suite's CPU rehearsal (GRPO_GPU_SUITE_ON_CPU=1) runs the same logic on a vocabulary the CPU handles quickly
VOCAB, POSITIONS, HIDDEN = (32768, 1024, 64) if ON_CPU else (QWEN_VOCAB, 8192, 256)


def head_call(layer: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor):
    """(logprob, entropy), each (N,), through the trainer's stand-in head on `layer` (as the model's forward calls
    it, hidden (1, N, H))."""
    head = _HeadStats(layer, targets[None], vocab=layer.out_features, temperature=1.0, with_entropy=True,
                      entropy_grad=True)
    head.select = lambda h: h
    out = head(hidden[None])
    return out[0, :, 0], out[0, :, 1]


def test_one_call_head_runs_the_device_chunk_and_matches_float32(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device=DEVICE, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.05)
    hidden = torch.randn(POSITIONS, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (POSITIONS,), device=DEVICE)
    weights = torch.randn(POSITIONS, device=DEVICE)
    chunks, real = [], chunked._linear_logits
    monkeypatch.setattr(chunked, "_linear_logits", lambda h, w, t: chunks.append(h.shape[0]) or real(h, w, t))
    lp, ent = head_call(layer, hidden, targets)
    ((lp * weights).sum() + 0.1 * (ent * weights.flip(0)).sum()).backward()
    rows = chunk_rows(VOCAB, device=hidden.device.type)
    n = -(-POSITIONS // rows)
    if not ON_CPU:
        assert (rows, n) == (1766, 5)  # 2^28 // 151,936 positions a chunk
    assert len(chunks) == 2 * n and max(chunks) == min(rows, POSITIONS)  # each chunk once in forward, once in backward

    # the reference: the whole (N, V) logits in float32 from the same bf16 values, torch's own autograd
    h32 = hidden.detach().float().requires_grad_(True)
    w32 = layer.weight.detach().float().requires_grad_(True)
    logp = torch.log_softmax(h32 @ w32.t(), dim=-1)
    ref_lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ((ref_lp * weights).sum() + 0.1 * (ref_ent * weights.flip(0)).sum()).backward()
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), rtol=0, atol=0.05)
    assert layer.weight.grad.dtype == torch.bfloat16
    for got, ref in ((layer.weight.grad, w32.grad), (hidden.grad, h32.grad)):
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert rel < 0.01, rel  # bf16 logits and one rounding of the result (float32 sum over the chunks)


@pytest.mark.skipif(ON_CPU, reason="CUDA memory figures")
def test_frozen_head_allocates_no_weight_gradient():
    """A frozen bf16 head (LoRA leaves `lm_head` frozen): the backward's peak stays below one (V, H) float32 buffer,
    while the same head trained needs more than that (its float32 gradient sum): the test can tell."""
    vocab, hidden_size, positions = QWEN_VOCAB, 2048, 256  # V·H·4 = 1.24 GB; one chunk's buffers ~0.5 GB
    torch.manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, device="cuda") * 0.02).bfloat16()
    targets = torch.randint(0, vocab, (positions,), device="cuda")

    def backward_peak(trained: bool) -> int:
        layer = torch.nn.Linear(hidden_size, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
        layer.weight.data.copy_(weight)
        layer.weight.requires_grad_(trained)
        hidden = torch.randn(positions, hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        lp, ent = head_call(layer, hidden, targets)
        loss = lp.sum() + ent.sum()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        assert hidden.grad is not None and (layer.weight.grad is not None) == trained
        return torch.cuda.max_memory_allocated() - start

    frozen, trained = backward_peak(False), backward_peak(True)
    assert frozen < vocab * hidden_size * 4 <= trained, (frozen, trained)
