"""IS correction (level x action x bounds) and the off-policy sequence mask: hand values, loops, invariants."""

import math

import pytest
import torch

from grpo_cli.algo.importance import IS_ACTIONS, IS_LEVELS, off_policy_sequence_mask, rollout_correction

LN = math.log
NAN = float("nan")
# log rho = old - sampler = [ln 3, ln 0.25, 0] on row 0; row 1 has a masked garbage token.
OLD = torch.tensor([[LN(3.0), LN(0.25), 0.0], [LN(0.75), 0.0, NAN]]) - 1.0
SAMPLER = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, float("inf")]]) - 1.0
MASK = torch.tensor([[True, True, True], [True, True, False]])


def weights(level, action, threshold=2.0, lower=None, enabled=True):
    return rollout_correction(OLD, SAMPLER, MASK, enabled=enabled, level=level, action=action, threshold=threshold,
                              lower=lower)


G = 0.75 ** (1 / 3)  # geometric mean of row 0's ratios [3, 0.25, 1]
H = 0.75 ** (1 / 2)  # geometric mean of row 1's ratios [0.75, 1]


@pytest.mark.parametrize(
    ("level", "action", "lower", "expected"),
    [
        ("token", "truncate", None, [[2.0, 0.25, 1.0], [0.75, 1.0, 1.0]]),
        ("token", "truncate", 0.5, [[2.0, 0.5, 1.0], [0.75, 1.0, 1.0]]),
        ("token", "mask", None, [[0.0, 0.0, 1.0], [0.75, 1.0, 1.0]]),  # bounds [1/2, 2]
        ("token", "mask", 0.2, [[0.0, 0.25, 1.0], [0.75, 1.0, 1.0]]),
        ("sequence_product", "truncate", None, [[0.75] * 3, [0.75, 0.75, 1.0]]),
        ("sequence_product", "mask", 0.8, [[0.0] * 3, [0.0, 0.0, 1.0]]),
        ("sequence_geometric", "truncate", None, [[G] * 3, [H, H, 1.0]]),
        ("sequence_geometric", "mask", 0.9, [[G] * 3, [0.0, 0.0, 1.0]]),  # G = 0.9086, H = 0.8660
    ],
)
def test_hand_computed(level, action, lower, expected):
    corr = weights(level, action, lower=lower)
    torch.testing.assert_close(corr.weights, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert not corr.weights.requires_grad and torch.isfinite(corr.log_rho).all()


def test_disabled_gives_ones_but_keeps_proposed_weights():
    corr = weights("token", "truncate", enabled=False)
    torch.testing.assert_close(corr.weights, torch.ones(2, 3))
    torch.testing.assert_close(corr.proposed, torch.tensor([[2.0, 0.25, 1.0], [0.75, 1.0, 1.0]]))
    assert corr.out_of_bounds.tolist() == [[True, False, False], [False, False, False]]


def naive_weights(old, sampler, mask, level, action, threshold, lower):
    out = []
    for ro, rs, rm in zip(old, sampler, mask):
        logs = [o - s for o, s, m in zip(ro, rs, rm) if m]
        seq = {"sequence_product": sum(logs), "sequence_geometric": sum(logs) / len(logs) if logs else 0.0}
        row = []
        for o, s, m in zip(ro, rs, rm):
            if not m:
                row.append(1.0)
                continue
            w = math.exp(max(-20.0, min(20.0, seq.get(level, o - s))))
            if action == "truncate":
                w = min(w, threshold) if lower is None else min(max(w, lower), threshold)
            else:
                low = 1 / threshold if lower is None else lower
                w = w if low <= w <= threshold else 0.0
            row.append(w)
        out.append(row)
    return out


@pytest.mark.parametrize("level", sorted(IS_LEVELS))
@pytest.mark.parametrize("action", sorted(IS_ACTIONS))
@pytest.mark.parametrize("lower", [None, 0.7])
def test_matches_naive_loop(level, action, lower):
    gen = torch.Generator().manual_seed(11)
    old = -torch.rand(5, 4, generator=gen) * 3
    sampler = old + 0.4 * torch.randn(5, 4, generator=gen)
    mask = torch.rand(5, 4, generator=gen) < 0.7
    corr = rollout_correction(old, sampler, mask, enabled=True, level=level, action=action, threshold=1.5,
                              lower=lower)
    expected = naive_weights(old.tolist(), sampler.tolist(), mask.tolist(), level, action, 1.5, lower)
    torch.testing.assert_close(corr.weights, torch.tensor(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("action", sorted(IS_ACTIONS))
def test_token_and_sequence_levels_agree_when_t_is_1(action):
    gen = torch.Generator().manual_seed(12)
    old = -torch.rand(6, 1, generator=gen)
    sampler = old + torch.randn(6, 1, generator=gen)
    mask = torch.ones(6, 1, dtype=torch.bool)
    results = [
        rollout_correction(old, sampler, mask, enabled=True, level=level, action=action, threshold=2.0, lower=None)
        for level in sorted(IS_LEVELS)
    ]
    for other in results[1:]:
        torch.testing.assert_close(other.weights, results[0].weights)


@pytest.mark.parametrize("level", sorted(IS_LEVELS))
@pytest.mark.parametrize("action", sorted(IS_ACTIONS))
def test_sampler_equal_old_gives_unit_weights(level, action):
    old = -torch.rand(3, 4)
    corr = rollout_correction(old, old.clone(), torch.rand(3, 4) < 0.5, enabled=True, level=level, action=action,
                              threshold=2.0, lower=None)
    torch.testing.assert_close(corr.weights, torch.ones(3, 4))


def test_non_finite_valid_log_ratio_raises():
    with pytest.raises(ValueError, match="old_logprobs - sampler_logprobs"):
        rollout_correction(torch.zeros(1, 2), torch.tensor([[0.0, -float("inf")]]), torch.ones(1, 2, dtype=torch.bool),
                           enabled=True, level="token", action="truncate", threshold=2.0, lower=None)


def test_opsm_hand_computed():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, NAN]])
    # delta = mean(sampler - logp): 0.6, 0.6, 0.1, 0.6 (last row: one valid token).
    sampler = torch.tensor([[-0.2, -0.6], [-0.4, -0.4], [-0.9, -0.9], [-0.4, 5.0]])
    mask = torch.tensor([[True, True], [True, True], [True, True], [True, False]])
    adv = torch.tensor([-1.0, 1.0, -1.0, -0.5])
    keep = off_policy_sequence_mask(logp, sampler, adv, mask, off_policy_sequence_mask_delta=0.5)
    assert keep.tolist() == [False, True, True, False]
    keep = off_policy_sequence_mask(logp, sampler, adv, mask, off_policy_sequence_mask_delta=None)
    assert keep.tolist() == [True] * 4
    token_adv = torch.tensor([[-2.0, 1.0], [1.0, 1.0], [-1.0, -1.0], [1.0, NAN]])  # masked mean -0.5, 1, -1, 1
    keep = off_policy_sequence_mask(logp, sampler, token_adv, mask, off_policy_sequence_mask_delta=0.5)
    assert keep.tolist() == [False, True, True, True]


def test_opsm_matches_naive_loop():
    gen = torch.Generator().manual_seed(13)
    logp = -torch.rand(8, 5, generator=gen)
    sampler = logp + 0.5 * torch.randn(8, 5, generator=gen)
    mask = torch.rand(8, 5, generator=gen) < 0.7
    adv = torch.randn(8, generator=gen)
    keep = off_policy_sequence_mask(logp, sampler, adv, mask, off_policy_sequence_mask_delta=0.1)
    expected = []
    for lp, sp, m, a in zip(logp.tolist(), sampler.tolist(), mask.tolist(), adv.tolist()):
        diffs = [s - p for s, p, v in zip(sp, lp, m) if v]
        delta = sum(diffs) / len(diffs) if diffs else 0.0
        expected.append(not (a < 0 and delta > 0.1))
    assert keep.tolist() == expected
