"""Issue 17: exact zeros, k3 gradient past the clamp, expm1 precision, CISPO as published, RLOO/REINFORCE++, entropy.

Each fix first reproduces the old failure; then fp32 `grpo_cli.algo` is checked against an independent float64
implementation (written here from the formulas of DESIGN.md §5) on random inputs with edge cases.
"""

import math

import pytest
import torch

from grpo_cli.algo.advantages import ADVANTAGE_ESTIMATORS, group_advantages, informative_groups
from grpo_cli.algo.entropy import token_entropy
from grpo_cli.algo.importance import rollout_correction
from grpo_cli.algo.kl import kl_penalty
from grpo_cli.algo.metrics import mismatch_metrics
from grpo_cli.algo.objectives import policy_objective

D = torch.float64


def ref_advantages(rewards, g, estimator, scale, eps):
    """float64 loops; NaN = missing; identical valid rewards -> 0."""
    out, centred_all = [], []
    groups = [rewards[i : i + g] for i in range(0, len(rewards), g)]
    valid_all = [r for r in rewards if not math.isnan(r)]

    def std(xs):
        if len(xs) < 2:
            return 0.0
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    for grp in groups:
        v = [r for r in grp if not math.isnan(r)]
        mean = sum(v) / len(v) if v else 0.0
        centred_all += [r - mean for r in v]
    for grp in groups:
        v = [r for r in grp if not math.isnan(r)]
        flat = len(v) < 2 or max(v) == min(v)
        mean = sum(v) / len(v) if v else 0.0
        for r in grp:
            if math.isnan(r) or flat:
                out.append(0.0)
            elif estimator == "rloo":
                out.append(r - (sum(v) - r) / (len(v) - 1))
            elif estimator == "reinforce_pp":
                out.append((r - mean) / (std(centred_all) + eps))
            else:
                div = {"group": std(v) + eps, "batch": std(valid_all) + eps, "none": 1.0}[scale]
                out.append((r - mean) / div)
    return out


CASES = [(e, s) for e in ("rloo", "reinforce_pp") for s in ("group",)] + [("grpo", s) for s in ("group", "batch", "none")]


@pytest.mark.parametrize(("estimator", "scale"), CASES)
@pytest.mark.parametrize(("value", "g"), [(1000.1, 64), (123.5, 64), (0.1, 3), (2.7, 16), (-5.3, 7)])
def test_identical_rewards_get_exactly_zero(estimator, scale, value, g):
    # Old fp32 stats: the 1000.1 group (G = 64) got |A| = 0.86 (one-ulp mean error over std ~1e-4 + eps).
    rewards = torch.full((2 * g,), value)
    rewards[g:] = torch.linspace(0, 1, g)  # a second, informative group beside it (batch/whitening use it)
    adv = group_advantages(rewards, g, estimator=estimator, scale_rewards=scale, epsilon=1e-4)
    assert (adv[:g] == 0).all(), adv[:g]
    assert informative_groups(rewards, g).tolist() == [False, True]


@pytest.mark.parametrize(("estimator", "scale"), CASES)
def test_advantages_match_float64_reference(estimator, scale):
    gen = torch.Generator().manual_seed(17)
    for trial in range(40):
        g = int(torch.randint(2, 9, (1,), generator=gen))
        p = int(torch.randint(1, 6, (1,), generator=gen))
        r = (torch.rand(p * g, generator=gen, dtype=D) * 10 - 3).round(decimals=int(trial % 3))
        r[torch.rand(p * g, generator=gen) < 0.15] = float("nan")
        if trial % 4 == 0:
            r[:g] = 1000.1  # identical group
        adv = group_advantages(r.float(), g, estimator=estimator, scale_rewards=scale, epsilon=1e-4)
        expected = ref_advantages(r.float().double().tolist(), g, estimator, scale, 1e-4)
        torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=D), rtol=2e-5, atol=2e-5)


def test_rloo_and_reinforce_pp_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 5.0, 1.0])
    # RLOO, G = 3: 1 - 0 = 1; 0 - 0.5 = -0.5 (twice); 3 - 3 = 0; 5 - 2 = 3; 1 - 4 = -3.
    rloo = group_advantages(r, 3, estimator="rloo", scale_rewards="group", epsilon=1e-4)
    torch.testing.assert_close(rloo, torch.tensor([1.0, -0.5, -0.5, 0.0, 3.0, -3.0]))
    # REINFORCE++: centred [2/3, -1/3, -1/3, 0, 2, -2]; Bessel std over 6 = sqrt((4/9+1/9+1/9+0+4+4)/5) = 1.3663.
    pp = group_advantages(r, 3, estimator="reinforce_pp", scale_rewards="group", epsilon=1e-4)
    std = math.sqrt((4 / 9 + 2 / 9 + 8) / 5)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 2.0, -2.0]) / (std + 1e-4)
    torch.testing.assert_close(pp, expected)
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce_pp"}


def k3_grad(x):
    logp = torch.zeros(1, 1, requires_grad=True)
    term = kl_penalty(logp, torch.full((1, 1), float(x)), torch.ones(1, 1, dtype=torch.bool), beta=1.0,
                      estimator="k3")
    term.kl.sum().backward()
    return float(logp.grad), float(term.kl.detach())


def test_k3_gradient_is_not_positive_past_the_clamp():
    # Old: clamp only inside exp gave d/dlogp = +1 at x = 21, pushing the policy away from the reference.
    grad, _ = k3_grad(21.0)
    assert grad <= 0.0
    assert grad == 0.0  # constant past the clamp
    grad, _ = k3_grad(5.0)
    assert grad == pytest.approx(1.0 - math.exp(5.0), rel=1e-6)
    grad, value = k3_grad(-40.0)  # exact for x << 0: e^-40 + 40 - 1
    assert value == pytest.approx(39.0, rel=1e-7) and grad == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("x", [1e-4, -1e-4, 3e-3, 1e-6, -2e-5])
def test_k3_small_x_relative_error(x):
    # Old: exp(x) - x - 1 in fp32 returned 0 at x = 1e-4.
    x32 = float(torch.tensor(x, dtype=torch.float32))  # the input the function really gets
    exact = math.expm1(x32) - x32
    _, value = k3_grad(x)
    assert abs(value - exact) / exact < 1e-5


def test_k3_kl_and_chi2_precise_for_bf16_size_mismatch():
    # log rho ~ 4e-3 (a bf16 rounding): old k3_kl read about 1% low.
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 50, generator=gen, dtype=D) * 3
    log_rho = torch.randn(4, 50, generator=gen, dtype=D) * 4e-3
    mask = torch.ones(4, 50, dtype=torch.bool)
    m = mismatch_metrics(old.float(), (old - log_rho).float(), mask, rollout_correction(
        old.float(), (old - log_rho).float(), mask, enabled=True, level="token", action="truncate", threshold=2.0,
        lower=None))
    lr = (old.float().double() - (old - log_rho).float().double())  # what fp32 inputs really hold
    k3_ref = (torch.expm1(lr) - lr).mean()
    chi2_ref = torch.expm1(2 * lr).mean()
    chi2_seq_ref = torch.expm1(2 * lr.sum(-1)).mean()
    assert abs(float(m["k3_kl"]) - float(k3_ref)) / float(k3_ref) < 1e-4
    assert abs(float(m["chi2_token"]) - float(chi2_ref)) / abs(float(chi2_ref)) < 1e-4
    assert abs(float(m["chi2_seq"]) - float(chi2_seq_ref)) / abs(float(chi2_seq_ref)) < 1e-4


def ref_cispo(logp, old, adv, mask, eh, low):
    r = torch.exp((logp - old).clamp(-20, 20))
    w = r.clamp(max=1 + eh) if low is None else r.clamp(min=1 - low, max=1 + eh)
    return torch.where(mask, -w * adv * logp, 0.0), torch.where(mask, -w * adv, 0.0)


@pytest.mark.parametrize("low", [None, 0.3])
def test_cispo_matches_float64_reference_with_huge_ratios_and_empty_rows(low):
    gen = torch.Generator().manual_seed(5)
    logp = -torch.rand(6, 9, generator=gen, dtype=D) * 4
    old = logp + torch.randn(6, 9, generator=gen, dtype=D) * 0.6
    old[0, :3] = logp[0, :3] + torch.tensor([25.0, -30.0, 21.0], dtype=D)  # |log ratio| > 20
    adv = torch.randn(6, 1, generator=gen, dtype=D).expand(6, 9)
    mask = torch.rand(6, 9, generator=gen) < 0.8
    mask[3] = False  # an all-masked row
    lp = logp.float().requires_grad_()
    out = policy_objective(lp, old.float(), adv[:, 0].float(), mask, kind="cispo", epsilon_low=0.2,
                           epsilon_high=4.0, dual_clip_c=None, cispo_epsilon_low=low)
    out.loss.sum().backward()
    loss, grad = ref_cispo(lp.detach().double(), old.float().double(), adv.float().double(), mask, 4.0, low)
    torch.testing.assert_close(out.loss.double(), loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp.grad.double(), grad, rtol=1e-5, atol=1e-6)
    assert (out.loss[3] == 0).all() and (lp.grad[3] == 0).all()


def test_cispo_weight_at_ratio_half_is_half():
    # Old: clamped below at 1 - eps_low = 0.8.
    logp = torch.full((1, 1), -1.0, requires_grad=True)
    out = policy_objective(logp, torch.full((1, 1), -1.0 + math.log(2.0)), torch.ones(1),
                           torch.ones(1, 1, dtype=torch.bool), kind="cispo", epsilon_low=0.2, epsilon_high=0.2,
                           dual_clip_c=None, cispo_epsilon_low=None)
    out.loss.sum().backward()
    assert float(logp.grad) == pytest.approx(-0.5)
    assert float(out.loss.detach()) == pytest.approx(-0.5 * 1.0 * -1.0)  # -w * A * logp, not -w * A * (logp - old)


def test_k3_matches_float64_reference_values_and_gradients():
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([torch.randn(200, generator=gen, dtype=D) * 3, torch.tensor([25.0, -25.0, 20.5, 1e-5], dtype=D)])
    logp = (-torch.rand(204, generator=gen, dtype=D) * 2).float()
    ref = (logp.double() + x).float()
    mask = torch.ones(1, 204, dtype=torch.bool)
    lp = logp[None].clone().requires_grad_()
    term = kl_penalty(lp, ref[None], mask, beta=1.0, estimator="k3")
    term.kl.sum().backward()
    xs = (ref.double() - logp.double())
    xh = xs.clamp(max=20)
    torch.testing.assert_close(term.kl[0].double(), torch.expm1(xh) - xh, rtol=1e-5, atol=1e-12)
    expected_grad = torch.where(xs > 20, 0.0, -torch.expm1(xh)).to(D)  # d/dlogp = (e^x - 1) * dx/dlogp
    torch.testing.assert_close(lp.grad[0].double(), expected_grad, rtol=1e-5, atol=1e-6)


def test_entropy_matches_float64_reference_and_gradient():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 5, 33, generator=gen, dtype=D) * 3
    logits[0, 0, :5] = -float("inf")  # banned tokens: 0 log 0 = 0
    finite = logits.clamp(min=-1e4)  # the float64 reference: exp(-1e4) = 0 exactly, without inf - inf
    weights = torch.randn(2, 5, generator=gen, dtype=D)

    def ref(z):
        logp = torch.log_softmax(z, -1)
        return -torch.where(logp.exp() > 0, logp.exp() * logp, 0.0).sum(-1)

    z64 = finite.clone().requires_grad_()
    (ref(z64) * weights).sum().backward()
    z32 = logits.float().requires_grad_()
    h = token_entropy(z32)
    (h * weights.float()).sum().backward()
    torch.testing.assert_close(h.double(), ref(finite), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z32.grad.double(), z64.grad, rtol=1e-4, atol=1e-6)
    uniform = token_entropy(torch.zeros(1, 7))
    torch.testing.assert_close(uniform, torch.full((1,), math.log(7.0)))


def test_compute_loss_end_to_end_matches_float64_reference():
    """CISPO x token-truncate IS + beta k3 - c H, truncated rows masked, token_mean: value and gradients."""
    from grpo_cli.config.algorithm import AlgorithmConfig
    from grpo_cli.train.loss import compute_loss

    gen = torch.Generator().manual_seed(21)
    b, t = 6, 7
    logp = -torch.rand(b, t, generator=gen, dtype=D) * 3
    old = logp + torch.randn(b, t, generator=gen, dtype=D) * 0.4
    sampler = old + torch.randn(b, t, generator=gen, dtype=D) * 0.3
    ref = logp + torch.randn(b, t, generator=gen, dtype=D) * 2
    ref[0, 0] = logp[0, 0] + 23.0  # past the k3 clamp
    old[1, 1] = logp[1, 1] - 25.0  # ratio past the exp clamp
    entropy = torch.rand(b, t, generator=gen, dtype=D) * 4
    adv = torch.randn(b, generator=gen, dtype=D)
    adv[2] = 0.0
    mask = torch.rand(b, t, generator=gen) < 0.8
    mask[3] = False
    truncated = torch.tensor([False, False, True, False, False, True])
    algo = AlgorithmConfig(objective={"kind": "cispo", "epsilon_high": 0.5}, kl={"beta": 0.05}, entropy_coef=0.01,
                           mask_truncated_completions=True)
    f = [x.float() for x in (logp, old, sampler, ref, entropy, adv)]
    lp32, h32 = f[0].clone().requires_grad_(), f[4].clone().requires_grad_()
    trained = mask & ~truncated[:, None]
    loss, _ = compute_loss(logprobs=lp32, old_logprobs=f[1], ref_logprobs=f[3], sampler_logprobs=f[2],
                           advantages=f[5], completion_mask=mask, algorithm=algo,
                           num_items_in_batch=float(trained.sum()), num_sequences_in_batch=b, max_completion_length=t,
                           entropy=h32, truncated=truncated)
    loss.backward()

    lp64, h64 = f[0].double().requires_grad_(), f[4].double().requires_grad_()
    o, s, rf, a = (x.double() for x in (f[1], f[2], f[3], f[5]))
    w = torch.exp((lp64 - o).clamp(-20, 20)).clamp(max=1.5).detach()
    rho = torch.exp((o - s).clamp(-20, 20)).clamp(max=2.0)
    xh = (rf - lp64).clamp(max=20)
    per_token = rho * (-w * a[:, None] * lp64) + 0.05 * (torch.expm1(xh) - xh) - 0.01 * h64
    expected = torch.where(trained, per_token, 0.0).sum() / trained.sum()
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp32.grad.double(), lp64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-5, atol=1e-7)
    # past the k3 clamp (x = 23) only the surrogate's gradient is left: the KL adds 0, not +beta
    assert bool(trained[0, 0])
    surrogate = (rho * -w * a[:, None])[0, 0] / trained.sum()
    assert float(lp32.grad[0, 0]) == pytest.approx(float(surrogate), rel=1e-5)


def test_mismatch_k3_and_chi2_match_float64_reference_with_edges():
    gen = torch.Generator().manual_seed(31)
    old = (-torch.rand(5, 8, generator=gen, dtype=D) * 3).float()
    sampler = (old.double() + torch.randn(5, 8, generator=gen, dtype=D) * 0.5).float()
    sampler[0, 0] = old[0, 0] - 24.0  # log rho = 24 > 20
    sampler[0, 1] = old[0, 1] + 22.0  # log rho = -22
    mask = torch.rand(5, 8, generator=gen) < 0.8
    mask[2] = False  # an all-masked row
    mask[0, :2] = True
    corr = rollout_correction(old, sampler, mask, enabled=True, level="token", action="truncate", threshold=2.0,
                              lower=None)
    m = mismatch_metrics(old, sampler, mask, corr)
    lr = (old.double() - sampler.double())
    rows = mask.any(-1)
    tok = lambda v: v[mask].mean()  # noqa: E731
    clamped = lr.clamp(-20, 20)
    xh = lr.clamp(max=20)
    seq_sum = torch.where(mask, lr, 0.0).sum(-1).clamp(-20, 20)
    seq_mean = (torch.where(mask, lr, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)).clamp(-20, 20)
    expected = {
        "k3_kl": tok(torch.expm1(xh) - xh),
        "chi2_token": tok(torch.expm1(2 * clamped)),
        "chi2_seq": torch.expm1(2 * seq_sum)[rows].mean(),
        "chi2_seq_geo": torch.expm1(2 * seq_mean)[rows].mean(),
        "kl": tok(-lr),
    }
    for name, value in expected.items():
        assert float(m[name]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), name
