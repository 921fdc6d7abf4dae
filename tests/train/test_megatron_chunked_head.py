"""Megatron's output layer a chunk of positions at a time (`VocabParallelHead`): inside a GPTModel-shaped forward
(hidden (S, B, H) → output layer → transpose), the logprobs, entropy and gradients equal those of the full
(B, S, V/tp) logits through `vocab_parallel_logprobs` (float32, 1e-6), tied weight passed in or the layer's own,
under grad and without; one rank of tensor parallel 1 (the all-reduces are identities). The 2-rank parity with ddp
(tensor and pipeline parallel) is tests/train/test_megatron.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from grpo_cli.train.backends.megatron import logprobs as L  # noqa: E402
from grpo_cli.train.backends.megatron import schedule  # noqa: E402

VOCAB, HIDDEN = 50, 8


class OutputLayer(torch.nn.Module):
    """ColumnParallelLinear's call contract: (s, b, h) and an optional weight → ((s, b, V/tp), bias)."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        self.output_size_per_partition = VOCAB
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN)) if own else None

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden @ (self.weight if weight is None else weight).t(), None


class GPT(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.post_process, self.tied = True, tied
        self.embedding = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN))
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.output_layer = OutputLayer(own=not tied)

    def forward(self, input_ids, position_ids, attention_mask):
        hidden = torch.tanh(self.mix(self.embedding[input_ids])).transpose(0, 1)  # (S, B, H)
        logits, _ = self.output_layer(hidden, weight=self.embedding if self.tied else None)
        return logits.transpose(0, 1).contiguous()


@pytest.fixture()
def one_rank(monkeypatch):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import mappings

    monkeypatch.setattr(mpu, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(mappings, "reduce_from_tensor_model_parallel_region", lambda x: x)
    monkeypatch.setattr(L, "chunk_rows", lambda vocab, *, device: 3)  # several chunks per micro-batch


def run(model, aligned, *, chunked: bool, entropy_grad: bool):
    model.zero_grad(set_to_none=True)
    head = L.VocabParallelHead.install(model, aligned, vocab_size=VOCAB, temperature=0.7, with_entropy=True,
                                       entropy_grad=entropy_grad) if chunked else None
    with head if head is not None else torch.enable_grad():
        output = model(input_ids=aligned.tokens, position_ids=aligned.positions, attention_mask=None)
    if head is not None:
        assert output.shape == (*aligned.targets.shape, 2)
        lp, h = head.split(output)
    else:
        lp, h = L.vocab_parallel_logprobs(schedule.completion_logits(output, aligned), aligned.targets,
                                          vocab_size=VOCAB, temperature=0.7, with_entropy=True,
                                          entropy_grad=entropy_grad)
    w = torch.linspace(-1, 1, lp.numel()).view_as(lp)
    ((lp * w).sum() + 0.3 * (h * w.flip(0)).sum()).backward()
    return lp.detach(), h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunked_head_equals_full_logits(one_rank, tied, entropy_grad):
    torch.manual_seed(0)
    model = GPT(tied)
    ids = torch.randint(0, VOCAB, (4, 11))
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0  # left padding
    mask[2:, -2:] = 0  # right padding
    aligned = L.right_aligned(ids, mask, 6)
    fast = run(model, aligned, chunked=True, entropy_grad=entropy_grad)
    assert "forward" not in model.output_layer.__dict__  # the layer's own forward is back
    ref = run(model, aligned, chunked=False, entropy_grad=entropy_grad)
    torch.testing.assert_close(fast[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast[1], ref[1], rtol=1e-6, atol=1e-6)
    assert fast[2].keys() == ref[2].keys() and ref[2]
    for name, g in ref[2].items():
        torch.testing.assert_close(fast[2][name], g, rtol=1e-6, atol=1e-6)


def test_sequence_parallel_keeps_the_full_logits_path():
    model = GPT(False)
    model.output_layer.sequence_parallel = True
    aligned = L.right_aligned(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), 2)
    assert L.VocabParallelHead.install(model, aligned, vocab_size=VOCAB, temperature=1.0, with_entropy=False,
                                       entropy_grad=False) is None


def bf16_head_grads(monkeypatch, h, w, ids, loss_w, *, chunk: int):
    """∂(Σ w·logprob)/∂W and ∂/∂h through `VocabParallelHead` on a bf16 output layer, `chunk` positions a chunk."""
    monkeypatch.setattr(L, "chunk_rows", lambda vocab, *, device: chunk)
    layer = OutputLayer(own=True)
    layer.output_size_per_partition, layer.weight = w.shape[0], torch.nn.Parameter(w.clone())
    hidden = torch.cat([h, h[:1]])[:, None, :].requires_grad_()  # (S, 1, H): positions 0..n−1 predict 1..n
    tokens = torch.cat([ids[:1], ids])[None]
    aligned = L.right_aligned(tokens, torch.ones_like(tokens), len(ids))
    head = L.VocabParallelHead(layer, aligned, vocab_size=w.shape[0], temperature=1.0, with_entropy=False,
                               entropy_grad=False)
    with head:
        output, _ = layer(hidden)
    lp, _ = head.split(output.transpose(0, 1))
    (lp[0] * loss_w).sum().backward()
    return hidden.grad[:-1, 0], layer.weight.grad


def test_bf16_weight_gradient_is_summed_in_float32(one_rank, monkeypatch):
    """Megatron's bf16 parameters (`Float16Module`), 342 chunks of 3 positions: the output layer's weight gradient
    is within 1.25x of one chunk's error (one GEMM rounded to bf16 once) from the float64 gradient. Through the
    layer's forward per chunk under checkpointing, autograd summed the chunks' bf16 gradients in bf16: measured
    1.2% against 0.36% for one chunk."""
    g = torch.Generator().manual_seed(0)
    n, vocab, width = 1024, 512, 64
    h = torch.randn(n, width, generator=g).bfloat16()
    w = (torch.randn(vocab, width, generator=g) * 0.3).bfloat16()
    ids, loss_w = torch.randint(0, vocab, (n,), generator=g), torch.randn(n, generator=g)
    dz = -loss_w.double()[:, None] * torch.softmax(h.double() @ w.double().t(), -1)
    dz[torch.arange(n), ids] += loss_w.double()
    ref_w, ref_h = dz.t() @ h.double(), dz @ w.double()

    def err(x, ref):
        return ((x.double() - ref).norm() / ref.norm()).item()

    many_h, many_w = bf16_head_grads(monkeypatch, h, w, ids, loss_w, chunk=3)
    one_h, one_w = bf16_head_grads(monkeypatch, h, w, ids, loss_w, chunk=n)
    assert many_w.dtype == torch.bfloat16 and err(one_w, ref_w) < 0.005
    assert err(many_w, ref_w) <= 1.25 * err(one_w, ref_w), (err(many_w, ref_w), err(one_w, ref_w))
    assert err(many_h, ref_h) <= 1.25 * err(one_h, ref_h)
