"""pass@k: the unbiased estimator 1 − C(n−c, k)/C(n, k), checked against values worked out by hand."""

from __future__ import annotations

from math import comb

import pytest
import torch

from grpo_cli.algo.pass_at_k import k_values, pass_at_k


def test_pass_at_k_hand_computed():
    # n = 4 samples per prompt; c = 0, 1, 2, 4 correct.
    c = torch.tensor([0, 1, 2, 4])
    # k = 1 is the fraction correct.
    assert pass_at_k(c, n=4, k=1).tolist() == pytest.approx([0.0, 0.25, 0.5, 1.0])
    # k = 2: 1 − C(4−c, 2)/C(4, 2) = 1 − {6, 3, 1, 0}/6.
    assert pass_at_k(c, n=4, k=2).tolist() == pytest.approx([0.0, 0.5, 5 / 6, 1.0])
    # k = 3: 1 − C(4−c, 3)/4 = 1 − {4, 1, 0, 0}/4.
    assert pass_at_k(c, n=4, k=3).tolist() == pytest.approx([0.0, 0.75, 1.0, 1.0])
    # k = n: any correct sample passes.
    assert pass_at_k(c, n=4, k=4).tolist() == [0.0, 1.0, 1.0, 1.0]


def test_pass_at_k_equals_the_binomial_formula():
    n = 16
    c = torch.arange(n + 1)
    for k in range(1, n + 1):
        want = [1 - comb(n - ci, k) / comb(n, k) for ci in c.tolist()]
        assert pass_at_k(c, n=n, k=k).tolist() == pytest.approx(want, abs=1e-12)


def test_k_values_and_bounds():
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(torch.tensor([1]), n=4, k=5)
