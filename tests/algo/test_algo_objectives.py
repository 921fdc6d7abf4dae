"""Objectives: hand-computed per-token losses, naive loop references, REINFORCE at ratio 1, masked garbage."""

import math

import pytest
import torch

from grpo_cli.algo.objectives import OBJECTIVES, policy_objective

LN = math.log
KINDS = sorted(OBJECTIVES)


def run(kind, lr, adv, mask=None, eps=(0.2, 0.2), c=None, logp0=None, cispo_low=None):
    logp = (torch.zeros_like(lr) if logp0 is None else logp0.clone()).requires_grad_()
    old = (logp - lr).detach()
    mask = torch.ones_like(lr, dtype=torch.bool) if mask is None else mask
    out = policy_objective(logp, old, adv, mask, kind=kind, epsilon_low=eps[0], epsilon_high=eps[1], dual_clip_c=c,
                           cispo_epsilon_low=cispo_low)
    return logp, out


def test_clip_hand_computed_with_clip_metrics_and_dual_clip():
    lr = torch.tensor([[LN(1.5), LN(0.5), LN(1.1), LN(0.7), LN(5.0)]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0]])
    _, out = run("clip", lr, adv)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.2, 0.8, 1.1, -0.7, 5.0]]))
    assert out.high_clipped.tolist() == [[True, False, False, False, False]]
    assert out.low_clipped.tolist() == [[False, True, False, False, False]]
    _, out = run("clip", lr, adv, c=3.0)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.2, 0.8, 1.1, -0.7, 3.0]]))
    _, out = run("clip", lr, adv, eps=(0.2, 0.6))  # clip-higher: 1.5 is inside [0.8, 1.6]
    torch.testing.assert_close(out.loss[0, 0], torch.tensor(-1.5))


def test_gspo_and_gspo_token_hand_computed():
    lr = torch.tensor([[0.2, 0.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    adv = torch.tensor([1.0])
    for kind in ("gspo", "gspo_token"):
        logp, out = run(kind, lr, adv, mask)  # s = exp(0.1) = 1.105171 inside [0.8, 1.2]
        torch.testing.assert_close(out.loss, torch.tensor([[-1.105171, -1.105171, 0.0]]))
        _, out = run(kind, lr, adv, mask, eps=(0.2, 0.05))  # clipped at 1.05
        torch.testing.assert_close(out.loss, torch.tensor([[-1.05, -1.05, 0.0]]))
        assert out.high_clipped.tolist() == [[True, True, False]]
    logp, out = run("gspo_token", lr, adv, mask)
    out.loss.sum().backward()  # each token's own gradient: -s * A
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.105171, -1.105171, 0.0]]))
    logp, out = run("gspo", lr, adv, mask)
    out.loss.sum().backward()  # two tokens share s: d/dlogp_t of -2 s = -2 s / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.105171, -1.105171, 0.0]]))


def test_cispo_hand_computed_as_published():
    """MiniMax-M1: w = min(r, 1 + eps_high), no lower clamp; loss = -w * A * logp; gradient = -w * A."""
    lr = torch.tensor([[LN(2.0), LN(0.5), LN(1.1)]])
    logp0 = torch.tensor([[-0.5, -2.0, -1.0]])
    logp, out = run("cispo", lr, torch.tensor([1.0]), logp0=logp0)
    # The old code clamped below too (weight 0.8 at r = 0.5) and logged -w * A * (logp - old).
    torch.testing.assert_close(out.loss, torch.tensor([[-1.2 * -0.5, -0.5 * -2.0, -1.1 * -1.0]]))
    out.loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2, -0.5, -1.1]]))
    # CISPO counts the weights it clipped, whatever the sign of A; nothing below without a lower clamp.
    _, out = run("cispo", lr, torch.tensor([-1.0]), logp0=logp0)
    assert out.high_clipped.tolist() == [[True, False, False]] and not out.low_clipped.any()


def test_cispo_optional_lower_clamp():
    lr = torch.tensor([[LN(2.0), LN(0.5), LN(1.1)]])
    logp, out = run("cispo", lr, torch.tensor([2.0]), logp0=torch.full((1, 3), -1.0), cispo_low=0.2)
    out.loss.sum().backward()  # w = [1.2, 0.8, 1.1]
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.4, -1.6, -2.2]]))
    assert out.low_clipped.tolist() == [[False, True, False]] and out.high_clipped.tolist() == [[True, False, False]]


def naive_token_loss(kind, lr, adv, mask, el, eh, c, logp):
    """Per-token loss values with Python floats (loops)."""
    out = []
    for i, (row_lr, row_a, row_m, row_lp) in enumerate(zip(lr, adv, mask, logp)):
        valid = [x for x, m in zip(row_lr, row_m) if m]
        seq = math.exp(sum(valid) / len(valid)) if valid else 1.0
        row = []
        for x, a, m, lp in zip(row_lr, row_a, row_m, row_lp):
            if not m:
                row.append(0.0)
                continue
            r = seq if kind in ("gspo", "gspo_token") else math.exp(x)
            if kind == "cispo":
                row.append(-min(r, 1 + eh) * a * lp)
                continue
            loss = max(-r * a, -min(max(r, 1 - el), 1 + eh) * a)
            if c is not None and a < 0:
                loss = min(loss, -c * a)
            row.append(loss)
        out.append(row)
    return out


@pytest.mark.parametrize(
    ("kind", "dual_clip_c"), [(k, None) for k in KINDS] + [(k, 2.0) for k in KINDS if k != "cispo"]
)
def test_objectives_match_naive_loop(kind, dual_clip_c):
    gen = torch.Generator().manual_seed(4)
    lr = torch.randn(5, 6, generator=gen) * 0.5
    adv = torch.randn(5, 6, generator=gen)
    mask = torch.rand(5, 6, generator=gen) < 0.7
    logp0 = -torch.rand(5, 6, generator=gen) * 3
    _, out = run(kind, lr, adv, mask, eps=(0.2, 0.28), c=dual_clip_c, logp0=logp0)
    expected = naive_token_loss(kind, lr.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, dual_clip_c, logp0.tolist())
    torch.testing.assert_close(out.loss, torch.tensor(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_ratio_one_gives_reinforce_gradient(kind):
    gen = torch.Generator().manual_seed(5)
    logp = (-torch.rand(3, 4, generator=gen) * 3).requires_grad_()
    adv = torch.randn(3, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    out = policy_objective(logp, logp.detach(), adv, mask, kind=kind, epsilon_low=0.2, epsilon_high=0.2,
                           dual_clip_c=None, cispo_epsilon_low=None)
    lengths = mask.sum(dim=1, keepdim=True).float()
    # seq_mean_token_mean aggregation: GSPO's shared sequence ratio gives the same gradient as REINFORCE here.
    (out.loss.sum(dim=1, keepdim=True) / lengths).sum().backward()
    expected = torch.where(mask, -adv[:, None] / lengths, torch.zeros(3, 4))
    torch.testing.assert_close(logp.grad, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_masked_garbage_changes_nothing(kind):
    gen = torch.Generator().manual_seed(6)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    base = -torch.rand(2, 4, generator=gen)
    old_base = base + 0.1 * torch.randn(2, 4, generator=gen)
    adv = torch.randn(2, 4, generator=gen)
    results = []
    for garbage in (0.0, float("nan"), float("inf"), -float("inf")):
        logp = torch.where(mask, base, torch.full_like(base, garbage)).requires_grad_()
        old = torch.where(mask, old_base, torch.full_like(base, -garbage))
        a = torch.where(mask, adv, torch.full_like(adv, garbage))
        out = policy_objective(logp, old, a, mask, kind=kind, epsilon_low=0.2, epsilon_high=0.2, dual_clip_c=None,
                               cispo_epsilon_low=None)
        out.loss.sum().backward()
        results.append((out.loss.detach(), logp.grad))
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        torch.testing.assert_close(grad, results[0][1])
    assert (results[0][1][~mask] == 0).all()


def test_non_finite_valid_log_ratio_raises():
    logp = torch.tensor([[-1.0, float("nan")]])
    with pytest.raises(ValueError, match="non-finite log-ratio"):
        policy_objective(logp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool), kind="clip",
                         epsilon_low=0.2, epsilon_high=0.2, dual_clip_c=None, cispo_epsilon_low=None)
    with pytest.raises(ValueError, match="advantages"):
        policy_objective(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([float("nan")]),
                         torch.ones(1, 2, dtype=torch.bool), kind="clip", epsilon_low=0.2, epsilon_high=0.2,
                         dual_clip_c=None, cispo_epsilon_low=None)


def test_huge_log_ratio_is_clamped_not_inf():
    _, out = run("clip", torch.tensor([[200.0, -200.0]]), torch.tensor([-1.0]))
    assert torch.isfinite(out.loss).all()
    torch.testing.assert_close(out.loss[0, 0], torch.tensor(math.exp(20.0)))
