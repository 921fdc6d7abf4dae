"""Mismatch and clip metrics: hand-computed values, a naive loop reference, sampler == old, empty batches."""

import math

import pytest
import torch

from grpo_cli.algo.importance import rollout_correction
from grpo_cli.algo.metrics import clip_metrics, mismatch_metrics
from grpo_cli.algo.objectives import policy_objective

NAN, INF = float("nan"), float("inf")
NAMES = {
    "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
    "chi2_seq_geo", "ess", "ess_seq", "is_weight_mean", "clipped_frac",
}


def metrics_for(old, sampler, mask, level="token", action="truncate", threshold=2.0, lower=None, enabled=True):
    corr = rollout_correction(old, sampler, mask, enabled=enabled, level=level, action=action, threshold=threshold,
                              lower=lower)
    return mismatch_metrics(old, sampler, mask, corr)


def test_hand_computed():
    # log rho = old - sampler: row 0 [0.5, 0], row 1 [0.2] (second token masked, garbage).
    old = torch.tensor([[-1.0, -2.0], [-0.5, NAN]])
    sampler = torch.tensor([[-1.5, -2.0], [-0.7, INF]])
    mask = torch.tensor([[True, True], [True, False]])
    m = metrics_for(old, sampler, mask)
    expected = {
        "kl": -0.233333,  # mean(-0.5, 0, -0.2)
        "k3_kl": 0.056708,  # mean(e^.5 - 1.5, 0, e^.2 - 1.2)
        "chi2_token": 0.736702,  # mean(e^1, 1, e^.4) - 1
        "training_log_ppl": 1.0,  # mean(1.5, 0.5)
        "training_ppl": 3.065205,  # mean(e^1.5, e^.5)
        "rollout_log_ppl": 1.225,  # mean(1.75, 0.7)
        "rollout_ppl": 3.884178,  # mean(e^1.75, e^.7)
        "log_ppl_diff": -0.225,  # mean(-0.25, -0.2)
        "log_ppl_abs_diff": 0.225,
        "log_ppl_diff_max": -0.2,
        "log_ppl_diff_min": -0.25,
        "ppl_ratio": 0.798766,  # mean(e^-.25, e^-.2)
        "chi2_seq": 1.105053,  # mean(e^(2*.5), e^(2*.2)) - 1
        "chi2_seq_geo": 0.570273,  # mean(e^(2*.25), e^(2*.2)) - 1
        "is_weight_mean": 1.290041,  # mean(e^.5, 1, e^.2), none above 2
        "ess": 0.958257,  # mean(w)^2 / mean(w^2)
        "ess_seq": 0.998367,  # over per-sequence mean weights [1.324361, 1.221403]
        "clipped_frac": 0.0,
    }
    assert set(m) == NAMES
    for name, value in expected.items():
        torch.testing.assert_close(m[name], torch.tensor(value), rtol=1e-5, atol=1e-6, msg=name)
    m = metrics_for(old, sampler, mask, threshold=1.5)  # e^.5 = 1.65 is truncated
    torch.testing.assert_close(m["clipped_frac"], torch.tensor(1 / 3))
    torch.testing.assert_close(m["is_weight_mean"], torch.tensor((1.5 + 1 + math.exp(0.2)) / 3))


def naive_metrics(old, sampler, mask, w):
    tok = [(o, s, wt) for ro, rs, rm, rw in zip(old, sampler, mask, w) for o, s, m, wt in zip(ro, rs, rm, rw) if m]
    rows = [[(o, s, wt) for o, s, m, wt in zip(ro, rs, rm, rw) if m] for ro, rs, rm, rw in zip(old, sampler, mask, w)]
    rows = [r for r in rows if r]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    e = lambda x: math.exp(max(-20.0, min(20.0, x)))  # noqa: E731
    diff = [mean([s for _, s, _ in r]) - mean([o for o, _, _ in r]) for r in rows]
    ess = lambda ws: mean(ws) ** 2 / mean([x * x for x in ws])  # noqa: E731
    return {
        "kl": mean([s - o for o, s, _ in tok]),
        "k3_kl": mean([e(o - s) - (o - s) - 1 for o, s, _ in tok]),
        "chi2_token": mean([e(o - s) ** 2 for o, s, _ in tok]) - 1,
        "training_log_ppl": mean([-mean([o for o, _, _ in r]) for r in rows]),
        "training_ppl": mean([e(-mean([o for o, _, _ in r])) for r in rows]),
        "rollout_log_ppl": mean([-mean([s for _, s, _ in r]) for r in rows]),
        "rollout_ppl": mean([e(-mean([s for _, s, _ in r])) for r in rows]),
        "log_ppl_diff": mean(diff),
        "log_ppl_abs_diff": mean([abs(d) for d in diff]),
        "log_ppl_diff_max": max(diff),
        "log_ppl_diff_min": min(diff),
        "ppl_ratio": mean([e(d) for d in diff]),
        "chi2_seq": mean([e(sum(o - s for o, s, _ in r)) ** 2 for r in rows]) - 1,
        "chi2_seq_geo": mean([e(mean([o - s for o, s, _ in r])) ** 2 for r in rows]) - 1,
        "is_weight_mean": mean([wt for _, _, wt in tok]),
        "ess": ess([wt for _, _, wt in tok]),
        "ess_seq": ess([mean([wt for _, _, wt in r]) for r in rows]),
    }


@pytest.mark.parametrize(("level", "action"), [("token", "truncate"), ("sequence_geometric", "mask")])
def test_matches_naive_loop(level, action):
    gen = torch.Generator().manual_seed(14)
    old = -torch.rand(6, 5, generator=gen) * 3
    sampler = old + 0.3 * torch.randn(6, 5, generator=gen)
    mask = torch.rand(6, 5, generator=gen) < 0.7
    mask[3] = False
    corr = rollout_correction(old, sampler, mask, enabled=True, level=level, action=action, threshold=1.3, lower=None)
    m = mismatch_metrics(old, sampler, mask, corr)
    expected = naive_metrics(old.tolist(), sampler.tolist(), mask.tolist(), corr.proposed.tolist())
    for name, value in expected.items():
        torch.testing.assert_close(m[name], torch.tensor(value, dtype=torch.float32), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("enabled", [True, False])
def test_sampler_equal_old_is_a_perfect_match(enabled):
    old = -torch.rand(4, 6) * 2
    mask = torch.rand(4, 6) < 0.6
    mask[0, 0] = True
    m = metrics_for(old, old.clone(), mask, level="sequence_product", action="mask", enabled=enabled)
    for name in ("kl", "k3_kl", "chi2_token", "chi2_seq", "chi2_seq_geo", "log_ppl_diff", "log_ppl_abs_diff",
                 "clipped_frac"):
        torch.testing.assert_close(m[name], torch.tensor(0.0), msg=name)
    for name in ("ess", "ess_seq", "is_weight_mean", "ppl_ratio"):
        torch.testing.assert_close(m[name], torch.tensor(1.0), msg=name)
    torch.testing.assert_close(m["training_ppl"], m["rollout_ppl"])


def test_empty_batch_gives_zeros():
    m = metrics_for(torch.full((2, 3), NAN), torch.full((2, 3), INF), torch.zeros(2, 3, dtype=torch.bool))
    assert set(m) == NAMES
    for name, value in m.items():
        assert value == 0.0, name


def test_clip_metrics_hand_computed():
    lr = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.5), 0.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False]])
    logp = torch.zeros(1, 4)
    out = policy_objective(logp, logp - lr, adv, mask, kind="clip", epsilon_low=0.2, epsilon_high=0.2,
                           dual_clip_c=None, cispo_epsilon_low=None)
    m = clip_metrics(out, mask)
    torch.testing.assert_close(m["low_mean"], torch.tensor(1 / 3))
    torch.testing.assert_close(m["high_mean"], torch.tensor(1 / 3))
    torch.testing.assert_close(m["region_mean"], torch.tensor(2 / 3))


def test_clip_metrics_match_naive_loop():
    gen = torch.Generator().manual_seed(24)
    lr, adv = 0.5 * torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) < 0.6
    logp = torch.zeros(4, 6)
    out = policy_objective(logp, logp - lr, adv, mask, kind="clip", epsilon_low=0.2, epsilon_high=0.28,
                           dual_clip_c=None, cispo_epsilon_low=None)
    m = clip_metrics(out, mask)
    toks = [(math.exp(x), a) for rx, ra, rm in zip(lr.tolist(), adv.tolist(), mask.tolist())
            for x, a, v in zip(rx, ra, rm) if v]
    low = [r < 0.8 and a < 0 for r, a in toks]
    high = [r > 1.28 and a > 0 for r, a in toks]
    torch.testing.assert_close(m["low_mean"], torch.tensor(sum(low) / len(toks)))
    torch.testing.assert_close(m["high_mean"], torch.tensor(sum(high) / len(toks)))
    torch.testing.assert_close(m["region_mean"], torch.tensor(sum(a or b for a, b in zip(low, high)) / len(toks)))
