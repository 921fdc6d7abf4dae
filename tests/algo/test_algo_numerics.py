"""Shared numerics: clamped exp, guarded log-ratios, masked reductions (hand values and naive loops)."""

import math

import pytest
import torch

from grpo_cli.algo.numerics import (
    as_mask,
    masked_log_ratio,
    row_extreme,
    row_mean,
    safe_exp,
    seq_mean,
    seq_sum,
    token_advantages,
    token_mean,
)

NAN = float("nan")


def test_safe_exp_clamps_to_20():
    torch.testing.assert_close(safe_exp(torch.tensor([0.0, 1.0, 50.0, -50.0])),
                               torch.tensor([1.0, math.e, math.exp(20.0), math.exp(-20.0)]))
    assert safe_exp(torch.tensor([1.0], dtype=torch.bfloat16)).dtype == torch.float32


def test_masked_log_ratio_zeroes_masked_and_raises_on_valid_non_finite():
    mask = torch.tensor([[True, False]])
    out = masked_log_ratio(torch.tensor([[-1.0, NAN]]), torch.tensor([[-3.0, 0.0]]), mask, name="x")
    torch.testing.assert_close(out, torch.tensor([[2.0, 0.0]]))
    with pytest.raises(ValueError, match="x: 1 non-finite"):
        masked_log_ratio(torch.tensor([[float("inf"), 0.0]]), torch.zeros(1, 2), mask, name="x")
    with pytest.raises(ValueError, match="shapes differ"):
        masked_log_ratio(torch.zeros(1, 3), torch.zeros(1, 2), mask, name="x")


def test_reductions_hand_computed_and_naive():
    values = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN], [NAN, NAN, NAN]])
    mask = as_mask(torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(seq_sum(values, mask), torch.tensor([3.0, 4.0, 0.0]))
    torch.testing.assert_close(seq_mean(values, mask), torch.tensor([1.5, 4.0, 0.0]))
    torch.testing.assert_close(token_mean(values, mask), torch.tensor(7 / 3))
    rows = mask.any(dim=-1)
    torch.testing.assert_close(row_mean(seq_mean(values, mask), rows), torch.tensor(2.75))
    torch.testing.assert_close(row_extreme(seq_mean(values, mask), rows, largest=True), torch.tensor(4.0))
    torch.testing.assert_close(row_extreme(seq_mean(values, mask), rows, largest=False), torch.tensor(1.5))
    none = torch.zeros(3, dtype=torch.bool)
    assert row_extreme(torch.ones(3), none, largest=True) == 0 and row_mean(torch.ones(3), none) == 0
    gen = torch.Generator().manual_seed(21)
    v, m = torch.randn(4, 5, generator=gen), torch.rand(4, 5, generator=gen) < 0.5
    sums = [sum(x for x, k in zip(rv, rm) if k) for rv, rm in zip(v.tolist(), m.tolist())]
    counts = [sum(rm) for rm in m.tolist()]
    torch.testing.assert_close(seq_sum(v, m), torch.tensor(sums))
    torch.testing.assert_close(seq_mean(v, m), torch.tensor([s / max(c, 1) for s, c in zip(sums, counts)]))
    torch.testing.assert_close(token_mean(v, m), torch.tensor(sum(sums) / max(sum(counts), 1)))


def test_token_advantages_broadcasts_and_validates():
    mask = torch.tensor([[True, False], [True, True]])
    torch.testing.assert_close(token_advantages(torch.tensor([2.0, -1.0]), mask), torch.tensor([[2.0, 0.0],
                                                                                                 [-1.0, -1.0]]))
    torch.testing.assert_close(token_advantages(torch.tensor([[1.0, NAN], [2.0, 3.0]]), mask),
                               torch.tensor([[1.0, 0.0], [2.0, 3.0]]))
    with pytest.raises(ValueError, match="advantages"):
        token_advantages(torch.tensor([[NAN, 0.0], [0.0, 0.0]]), mask)
    with pytest.raises(ValueError, match="shape"):
        token_advantages(torch.zeros(2, 3), mask)
