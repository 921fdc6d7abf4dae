"""KL estimators k1, k2, k3: hand-computed values, naive loops, clamps, masked garbage."""

import math

import pytest
import torch

from grpo_cli.algo.kl import KL_ESTIMATORS, kl_penalty

MASK3 = torch.ones(1, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [-0.5, 0.5, 0.0]),
        ("k2", [0.125, 0.125, 0.0]),
        ("k3", [0.148721, 0.106531, 0.0]),  # e^0.5 - 1.5, e^-0.5 - 0.5
    ],
)
def test_hand_computed(estimator, expected):
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-0.5, -1.5, -1.0]])  # x = ref - logp = [0.5, -0.5, 0]
    term = kl_penalty(logp, ref, MASK3, beta=0.1, estimator=estimator)
    torch.testing.assert_close(term.kl, torch.tensor([expected]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(term.penalty, 0.1 * torch.tensor([expected]), rtol=1e-5, atol=1e-6)


NAIVE = {
    "k1": lambda x: -x,
    "k2": lambda x: 0.5 * x * x,
    "k3": lambda x: math.exp(max(min(x, 20.0), -20.0)) - x - 1.0,
}


@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
def test_matches_naive_loop_and_gradient(estimator):
    gen = torch.Generator().manual_seed(9)
    logp = (-torch.rand(4, 5, generator=gen) * 4).requires_grad_()
    ref = -torch.rand(4, 5, generator=gen) * 4
    mask = torch.rand(4, 5, generator=gen) < 0.7
    term = kl_penalty(logp, ref, mask, beta=1.0, estimator=estimator)
    expected = [
        [NAIVE[estimator](r - p) if m else 0.0 for p, r, m in zip(rp, rr, rm)]
        for rp, rr, rm in zip(logp.tolist(), ref.tolist(), mask.tolist())
    ]
    torch.testing.assert_close(term.kl, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    term.penalty.sum().backward()
    x = (ref - logp.detach())
    dk_dlogp = {"k1": torch.ones_like(x), "k2": -x, "k3": 1.0 - torch.exp(x)}[estimator]
    torch.testing.assert_close(logp.grad, torch.where(mask, dk_dlogp, torch.zeros_like(x)), rtol=1e-5, atol=1e-6)


def test_k3_clamps_exp_input_and_k2_k3_non_negative():
    term = kl_penalty(torch.tensor([[-100.0, 0.0]]), torch.tensor([[0.0, -100.0]]), torch.ones(1, 2, dtype=torch.bool),
                      beta=1.0, estimator="k3")
    torch.testing.assert_close(term.kl, torch.tensor([[math.exp(20.0) - 101.0, 99.0]]))
    gen = torch.Generator().manual_seed(10)
    logp, ref = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    for estimator in ("k2", "k3"):
        assert (kl_penalty(logp, ref, torch.ones(3, 4, dtype=torch.bool), beta=1.0, estimator=estimator).kl >= 0).all()


def test_masked_garbage_and_non_finite_valid():
    mask = torch.tensor([[True, False]])
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    term = kl_penalty(logp, torch.tensor([[-0.5, float("inf")]]), mask, beta=1.0, estimator="k3")
    term.penalty.sum().backward()
    assert torch.isfinite(term.kl).all() and term.kl[0, 1] == 0 and logp.grad[0, 1] == 0
    with pytest.raises(ValueError, match="ref_logprobs - logprobs"):
        kl_penalty(logp, torch.tensor([[-float("inf"), 0.0]]), mask, beta=1.0, estimator="k1")
