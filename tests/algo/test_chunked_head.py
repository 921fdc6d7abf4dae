"""The chunked output layer's hand-written backward (`algo.chunked_logprobs._LinearHead`) against float64 math: the
chunk follows the device (larger on CUDA, a pure function a CPU test drives), the weight gradient of bf16 weights is
summed over chunks in float32 (as close to the float64 gradient as one bf16 GEMM), and an input that needs no
gradient (LoRA's frozen head) gets neither a (V, H) buffer nor a GEMM, leaving the other gradient unchanged, and
without an entropy gradient each chunk's backward allocates one (n, V) buffer."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from grpo_cli.algo.chunk_size import CPU_CHUNK_ELEMENTS, CUDA_CHUNK_ELEMENTS, chunk_rows
from grpo_cli.algo.chunked_logprobs import chunked_logprobs

QWEN_VOCAB = 151_936


@pytest.mark.parametrize(("device", "rows", "chunks"), [("cuda", 1766, 5), ("cpu", 110, 75), ("mps", 110, 75)])
def test_the_chunk_follows_the_device(device, rows, chunks):
    """Qwen's vocabulary, an 8,192-position micro-batch: on CUDA 2^28 logits a chunk (5 chunks, so the head's
    backward passes over its (V, H) weight gradient 5 times, not 75); on the CPU, and any other device, 2^24."""
    assert (CUDA_CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS) == (1 << 28, 1 << 24)
    assert chunk_rows(QWEN_VOCAB, device=device) == rows == (1 << (28 if device == "cuda" else 24)) // QWEN_VOCAB
    assert -(-8192 // rows) == chunks
    assert chunk_rows(1 << 30, device="cuda") == 1  # at least one position


def problem(n: int, vocab: int, hidden: int, *, dtype=torch.bfloat16, seed: int = 0):
    """Random hidden states (n, H), weight (V, H), targets and per-position loss weights, and the float64
    gradients of Σ w·logprob with respect to the weight and the hidden states, from the same (rounded) inputs."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    ids, loss_w = torch.randint(0, vocab, (n,), generator=g), torch.randn(n, generator=g)
    p = torch.softmax(h.double() @ w.double().t(), -1)
    dz = -loss_w.double()[:, None] * p  # ∂/∂z of w·(z[id] − lse) = w·(onehot(id) − p)
    dz[torch.arange(n), ids] += loss_w.double()
    return h, w, ids, loss_w, {"weight": dz.t() @ h.double(), "hidden": dz @ w.double()}


def head_grads(h, w, ids, loss_w, *, chunk: int, weight_grad: bool = True, hidden_grad: bool = True):
    h, w = h.clone().requires_grad_(hidden_grad), w.clone().requires_grad_(weight_grad)
    lp, _ = chunked_logprobs(h, ids, project=None, weight=w, temperature=1.0, chunk=chunk, with_entropy=False,
                             entropy_grad=False, shard=None)
    (lp * loss_w).sum().backward()
    return h.grad, w.grad


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_bf16_weight_gradient_is_summed_in_float32():
    """256 chunks of 4 positions, bf16 weights (fsdp2's param dtype, ZeRO, PEFT): the weight gradient is within
    1.25x of one chunk's error (one GEMM, rounded to bf16 once; here 0.36% from the float64 gradient). A bf16 running
    sum rounds at every chunk: measured 1.08% for these inputs before the float32 buffer."""
    h, w, ids, loss_w, ref = problem(1024, 512, 64)
    many_h, many_w = head_grads(h, w, ids, loss_w, chunk=4)
    one_h, one_w = head_grads(h, w, ids, loss_w, chunk=1024)
    assert many_w.dtype == torch.bfloat16 and one_w.dtype == torch.bfloat16
    one = rel_err(one_w, ref["weight"])
    assert one < 0.005, one  # bf16 logits and one rounding of the result
    assert rel_err(many_w, ref["weight"]) <= 1.25 * one, (rel_err(many_w, ref["weight"]), one)
    assert rel_err(many_h, ref["hidden"]) <= 1.25 * rel_err(one_h, ref["hidden"])


def test_float32_weight_gradient_matches_float64():
    h, w, ids, loss_w, ref = problem(96, 64, 16, dtype=torch.float32)
    grad_h, grad_w = head_grads(h, w, ids, loss_w, chunk=7)
    assert grad_w.dtype == torch.float32
    assert rel_err(grad_w, ref["weight"]) < 1e-6 and rel_err(grad_h, ref["hidden"]) < 1e-6


def gemms_and_big_allocations(h, w, ids, loss_w, *, chunk: int, weight_grad: bool, hidden_grad: bool):
    """The backward's GEMMs of each kind (∂W: (V, n) x (n, H); ∂h: (n, V) x (V, H)), the ops that allocated a (V, H)
    float32 buffer or more, and the gradients."""
    n, vocab, hidden = chunk, w.shape[0], w.shape[1]
    h, w = h.clone().requires_grad_(hidden_grad), w.clone().requires_grad_(weight_grad)
    lp, _ = chunked_logprobs(h, ids, project=None, weight=w, temperature=0.7, chunk=chunk, with_entropy=False,
                             entropy_grad=False, shard=None)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        (lp * loss_w).sum().backward()
    events = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::addmm_")]
    weight_gemms = sum([vocab, n] in e.input_shapes and [n, hidden] in e.input_shapes for e in events)
    hidden_gemms = sum([n, vocab] in e.input_shapes and [vocab, hidden] in e.input_shapes for e in events)
    big = [e.name for e in prof.events() if e.cpu_memory_usage >= vocab * hidden * 4]
    return weight_gemms, hidden_gemms, big, h.grad, w.grad


def test_a_frozen_head_gets_no_weight_gradient():
    """LoRA's `all-linear` leaves the head frozen: the backward allocates no (V, H) buffer and runs no ∂W GEMM, and
    ∂/∂h is the trained head's, bit for bit; likewise hidden states that need no gradient get no ∂h GEMM."""
    h, w, ids, loss_w, _ = problem(40, 512, 24, dtype=torch.float32)
    both = gemms_and_big_allocations(h, w, ids, loss_w, chunk=8, weight_grad=True, hidden_grad=True)
    assert both[:2] == (5, 5) and both[2]  # the test can tell: 5 chunks of each, and a (V, H) buffer
    frozen = gemms_and_big_allocations(h, w, ids, loss_w, chunk=8, weight_grad=False, hidden_grad=True)
    assert frozen[:3] == (0, 5, []) and frozen[4] is None
    assert torch.equal(frozen[3], both[3])
    trunk = gemms_and_big_allocations(h, w, ids, loss_w, chunk=8, weight_grad=True, hidden_grad=False)
    assert trunk[:2] == (5, 0) and trunk[3] is None
    assert torch.equal(trunk[4], both[4])


def test_without_an_entropy_gradient_the_backward_allocates_one_logits_buffer_per_chunk():
    """The gradient of the logits (−g·p, then + g at the target) is written over the chunk's recomputed logits: each
    chunk of the backward allocates one (n, V) float32 buffer (the logits), and its exp is taken in place (at CUDA's
    chunk of 2^28 logits, a second buffer is 1 GiB)."""
    chunk, vocab = 8, 512
    h, w, ids, loss_w, ref = problem(40, vocab, 16, dtype=torch.float32)
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, _ = chunked_logprobs(h, ids, project=None, weight=w, temperature=1.0, chunk=chunk, with_entropy=False,
                             entropy_grad=False, shard=None)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (lp * loss_w).sum().backward()
    logits_sized = [e.name for e in prof.events() if chunk * vocab * 4 <= e.self_cpu_memory_usage < vocab * 16 * 4]
    assert sorted(set(logits_sized)) == ["aten::mm"] and len(logits_sized) == 40 // chunk, logits_sized
    assert rel_err(w.grad, ref["weight"]) < 1e-6 and rel_err(h.grad, ref["hidden"]) < 1e-6


def test_entropy_of_a_vocabulary_shard_with_padding_columns_matches_float64():
    """A tensor-parallel shard whose last columns are padding (ids past the vocabulary: logit −inf, p = 0) adds 0 to
    the entropy, not NaN (0 · log 0 taken as 0), in the forward and in the entropy's gradient; one shard holding the
    whole vocabulary plus 5 padding rows, its all-reduce the identity."""
    from grpo_cli.algo.chunked_logprobs import VocabShard

    vocab, pad, hidden = 60, 5, 16
    h, w, ids, loss_w, _ = problem(24, vocab + pad, hidden, dtype=torch.float32)
    ids = ids % vocab
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = chunked_logprobs(h, ids, project=None, weight=w, temperature=1.0, chunk=7, with_entropy=True,
                               entropy_grad=True, shard=VocabShard(0, vocab, lambda x, op: None))
    (lp * loss_w + ent).sum().backward()
    hd, wd = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    logp = torch.log_softmax(hd @ wd[:vocab].t(), -1)
    ref_lp, ref_ent = logp.gather(-1, ids[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    (ref_lp * loss_w.double() + ref_ent).sum().backward()
    assert not ent.isnan().any() and rel_err(ent, ref_ent) < 1e-6 and rel_err(lp, ref_lp) < 1e-6
    assert rel_err(h.grad, hd.grad) < 1e-5 and rel_err(w.grad, wd.grad) < 1e-5
    assert torch.count_nonzero(w.grad[vocab:]) == 0  # the padding rows get no gradient


class _TwoShards:
    """The all-reduce of two vocabulary shards run by two threads of this process (a barrier exchanges the values)."""

    def __init__(self) -> None:
        import threading

        self.barrier, self.slots = threading.Barrier(2, timeout=60), [None, None]

    def reducer(self, rank: int):
        def all_reduce(x: torch.Tensor, op: str) -> None:
            self.slots[rank] = x.clone()
            self.barrier.wait()
            other = self.slots[1 - rank]
            total = torch.maximum(x, other) if op == "max" else x + other
            self.barrier.wait()
            x.copy_(total)
        return all_reduce


@pytest.mark.parametrize("scale", [1.0, 40.0, 0.0])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_a_vocabulary_split_in_two_matches_float64(scale, with_entropy):
    """The vocabulary cut into two shards (rows 0..29 and 30..59 of the weight, one thread each, as the
    sequence-parallel and tensor-parallel heads run them): the log-sum-exp from each shard's exp(z − m) sum, the
    entropy as Σ entr(e)/S + log S, the picked logit from the shard that holds the id, and the gradients of the
    hidden states (summed over the shards) and of each shard's rows equal float64 softmax math. Logits of order 1,
    logits over 20 in magnitude (scale 40: one shard's rows all but vanish for many positions), and identical logits
    (scale 0: the entropy is log V, the gradient of the hidden states only from the picked rows)."""
    import threading

    from grpo_cli.algo.chunked_logprobs import VocabShard

    vocab, hidden, temperature = 60, 16, 0.7
    h, w, ids, loss_w, _ = problem(23, vocab, hidden, dtype=torch.float32, seed=3)
    h = h * scale if scale else h
    w = w if scale else torch.zeros_like(w)
    pair, results = _TwoShards(), [None, None]

    def shard(rank: int) -> None:
        hr = h.clone().requires_grad_(True)
        wr = w[rank * 30 : (rank + 1) * 30].clone().requires_grad_(True)
        lp, ent = chunked_logprobs(hr, ids, project=None, weight=wr, temperature=temperature, chunk=7,
                                   with_entropy=with_entropy, entropy_grad=with_entropy,
                                   shard=VocabShard(rank * 30, vocab, pair.reducer(rank)))
        loss = (lp * loss_w).sum() + (ent.sum() if with_entropy else 0.0)
        loss.backward()
        results[rank] = (lp.detach(), None if ent is None else ent.detach(), hr.grad, wr.grad)

    threads = [threading.Thread(target=shard, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results)
    hd, wd = h.double().requires_grad_(True), w.double().requires_grad_(True)
    logp = torch.log_softmax(hd @ wd.t() / temperature, -1)
    ref_lp, ref_ent = logp.gather(-1, ids[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ((ref_lp * loss_w.double()).sum() + (ref_ent.sum() if with_entropy else 0.0)).backward()
    for rank, (lp, ent, h_grad, w_grad) in enumerate(results):
        assert torch.allclose(lp.double(), ref_lp, rtol=1e-5, atol=1e-5), (rank, (lp - ref_lp).abs().max())
        if with_entropy:
            assert not ent.isnan().any() and torch.allclose(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        assert torch.allclose(h_grad.double(), hd.grad, rtol=1e-4, atol=1e-5 * max(1.0, scale))
        assert torch.allclose(w_grad.double(), wd.grad[rank * 30 : (rank + 1) * 30], rtol=1e-4,
                              atol=1e-5 * max(1.0, scale))
    if not scale:
        assert torch.allclose(results[0][0].double(), torch.full((23,), -torch.log(torch.tensor(60.0)).item(),
                                                                 dtype=torch.float64))
