"""Advantages: hand-computed values, a naive loop reference, zero-mean groups, NaN (None) rewards."""

import math

import pytest
import torch

from grpo_cli.algo.advantages import group_advantages, process_advantages, weighted_rewards

NAN = float("nan")


def naive_group_advantages(rewards, group_size, scale_rewards, epsilon):
    def stats(values):
        n = len(values)
        mean = sum(values) / n if n else 0.0
        var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
        return mean, math.sqrt(var)

    valid_all = [r for r in rewards if not math.isnan(r)]
    _, batch_std = stats(valid_all)
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean, std = stats([r for r in group if not math.isnan(r)])
        scale = {"group": std + epsilon, "batch": batch_std + epsilon, "none": 1.0}[scale_rewards]
        out += [0.0 if math.isnan(r) else (r - mean) / scale for r in group]
    return out


def test_group_advantages_hand_computed():
    # group 0: mean 0.5, Bessel std sqrt(0.5) = 0.707107 -> ±0.5 / 0.707207; group 1: identical -> 0.
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, estimator="grpo", scale_rewards="group", epsilon=1e-4)
    torch.testing.assert_close(adv, torch.tensor([0.707007, -0.707007, 0.0, 0.0]), rtol=1e-5, atol=1e-6)


def test_group_advantages_nan_excluded_from_stats():
    # group 0 valid {1, 3}: mean 2, std sqrt(2) = 1.414214; the NaN row gets 0.
    adv = group_advantages(torch.tensor([1.0, NAN, 3.0, 2.0, 2.0, 2.0]), 3, estimator="grpo", scale_rewards="group",
                           epsilon=1e-4)
    expected = torch.tensor([-0.707057, 0.0, 0.707057, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)


def test_group_advantages_batch_and_none_hand_computed():
    # batch std of [0, 1, 2, 3] = sqrt(5/3) = 1.290994; group means 0.5 and 2.5.
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, estimator="grpo", scale_rewards="batch", epsilon=1e-4)
    torch.testing.assert_close(adv, torch.tensor([-0.387268, 0.387268, -0.387268, 0.387268]), rtol=1e-5, atol=1e-6)
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0, 4.0]), 2, estimator="grpo", scale_rewards="none", epsilon=1e-4)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -1.0, 1.0]))


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_match_naive_loop(scale_rewards):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=gen) * 3
    rewards[torch.rand(24, generator=gen) < 0.2] = NAN
    rewards[:4] = NAN  # one all-None group
    adv = group_advantages(rewards, 4, estimator="grpo", scale_rewards=scale_rewards, epsilon=1e-4)
    expected = naive_group_advantages(rewards.tolist(), 4, scale_rewards, 1e-4)
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_zero_mean_per_group(scale_rewards):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.rand(32, generator=gen)
    rewards[torch.rand(32, generator=gen) < 0.25] = NAN
    adv = group_advantages(rewards, 8, estimator="grpo", scale_rewards=scale_rewards, epsilon=1e-4).reshape(4, 8)
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(4), atol=1e-5, rtol=0)


def test_group_advantages_rejects_bad_shapes_and_inf():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3, estimator="grpo", scale_rewards="group", epsilon=1e-4)
    with pytest.raises(ValueError, match="inf"):
        group_advantages(torch.tensor([1.0, float("inf")]), 2, estimator="grpo", scale_rewards="group", epsilon=1e-4)


def test_weighted_rewards_hand_computed_and_naive():
    r = torch.tensor([[1.0, NAN], [NAN, NAN], [2.0, 3.0]])
    out = weighted_rewards(r, [1.0, 0.5])
    torch.testing.assert_close(out, torch.tensor([1.0, NAN, 3.5]), equal_nan=True)
    gen = torch.Generator().manual_seed(2)
    r = torch.randn(10, 3, generator=gen)
    r[torch.rand(10, 3, generator=gen) < 0.3] = NAN
    w = [0.5, -1.0, 2.0]
    expected = []
    for row in r.tolist():
        scored = [(v, wf) for v, wf in zip(row, w) if not math.isnan(v)]
        expected.append(sum(v * wf for v, wf in scored) if scored else NAN)
    torch.testing.assert_close(weighted_rewards(r, w), torch.tensor(expected), equal_nan=True)
    with pytest.raises(ValueError, match="weights"):
        weighted_rewards(r, [1.0])


def naive_process_advantages(step_rewards, step_ends, group_size, num_tokens, scale_rewards, epsilon):
    flat = [r for row in step_rewards for r in row]
    norm_flat = naive_group_advantages(flat, group_size * len(step_rewards[0]), scale_rewards, epsilon)
    s = len(step_rewards[0])
    out = []
    for i, (rews, ends) in enumerate(zip(step_rewards, step_ends)):
        norm = norm_flat[i * s : (i + 1) * s]
        row = []
        for t in range(num_tokens):
            row.append(sum(n for n, r, e in zip(norm, rews, ends) if not math.isnan(r) and e >= t))
        out.append(row)
    return out


def test_process_advantages_hand_computed():
    # group step rewards {1, 0, 1}: mean 2/3, Bessel std sqrt(1/3) = 0.577350 -> r~ = 0.577250, -1.154500, 0.577250
    step_rewards = torch.tensor([[1.0, 0.0], [1.0, NAN]])
    step_ends = torch.tensor([[1, 4], [2, 0]])
    adv = process_advantages(step_rewards, step_ends, 2, 5, estimator="grpo", scale_rewards="group", epsilon=1e-4)
    expected = torch.tensor(
        [[-0.577250, -0.577250, -1.154500, -1.154500, -1.154500], [0.577250, 0.577250, 0.577250, 0.0, 0.0]]
    )
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_process_advantages_match_naive_and_zero_mean(scale_rewards):
    gen = torch.Generator().manual_seed(3)
    b, s, t = 8, 3, 7
    step_rewards = torch.randn(b, s, generator=gen)
    step_rewards[torch.rand(b, s, generator=gen) < 0.3] = NAN
    step_ends = torch.randint(0, t, (b, s), generator=gen)
    adv = process_advantages(step_rewards, step_ends, 4, t, estimator="grpo", scale_rewards=scale_rewards, epsilon=1e-4)
    expected = naive_process_advantages(step_rewards.tolist(), step_ends.tolist(), 4, t, scale_rewards, 1e-4)
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    # Token 0 sums every step of its sequence, so over a group it sums all normalised steps: zero.
    torch.testing.assert_close(adv[:, 0].reshape(2, 4).sum(dim=1), torch.zeros(2), atol=1e-5, rtol=0)


def test_process_advantages_rejects_out_of_range_ends():
    with pytest.raises(ValueError, match="step_ends"):
        process_advantages(torch.tensor([[1.0], [0.0]]), torch.tensor([[5], [0]]), 2, 5, estimator="grpo",
                           scale_rewards="group", epsilon=1e-4)
