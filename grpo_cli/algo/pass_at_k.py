"""pass@k with the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code")."""

from __future__ import annotations

import torch


def pass_at_k(num_correct: torch.Tensor, *, n: int, k: int) -> torch.Tensor:
    """Per-prompt pass@k (P,) from the number of correct completions c (P,) out of n samples each:

        pass@k = 1 − C(n−c, k) / C(n, k) = 1 − ∏_{i=n−c+1}^{n} (1 − k/i)

    (the product form avoids huge binomials); exactly 1 when n − c < k. Requires 1 ≤ k ≤ n."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = num_correct.to(torch.float64)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    factors = 1.0 - k / i  # (n,)
    in_product = i[None, :] > (n - c)[:, None]  # i in n−c+1 .. n
    prob_all_wrong = torch.where(in_product, factors[None, :], torch.ones_like(factors)[None, :]).prod(dim=1)
    return torch.where(n - c < k, torch.ones_like(c), 1.0 - prob_all_wrong)


def k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, … up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]
