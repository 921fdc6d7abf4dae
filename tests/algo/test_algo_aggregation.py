"""Aggregation: hand-computed values, naive loops, and micro-batch split invariance."""

import pytest
import torch

from grpo_cli.algo.aggregation import AGGREGATIONS, aggregate_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


def agg(name, loss, mask, n_items, n_seqs, max_len=4):
    return aggregate_loss(loss, mask, aggregation=name, num_items_in_batch=n_items, num_sequences_in_batch=n_seqs,
                          max_completion_length=max_len)


@pytest.mark.parametrize(
    ("name", "n_items", "n_seqs", "expected"),
    [
        ("token_mean", 3, 2, 7 / 3),  # (1 + 2 + 4) / 3
        ("token_mean", 10, 2, 0.7),  # denominator of the whole step, not of this micro-batch
        ("token_mean_local", 10, 4, 7 / 6),  # local mean 7/3, times b/B = 2/4
        ("seq_mean_token_mean", 3, 2, 2.75),  # (1.5 + 4) / 2
        ("seq_mean_token_sum_norm", 3, 2, 7 / 8),  # 7 / (2 * 4)
    ],
)
def test_hand_computed(name, n_items, n_seqs, expected):
    torch.testing.assert_close(agg(name, LOSS, MASK, n_items, n_seqs), torch.tensor(expected))


def naive(name, loss, mask, n_items, n_seqs, max_len):
    rows = [[x for x, m in zip(r, mr) if m] for r, mr in zip(loss.tolist(), mask.tolist())]
    total = sum(sum(r) for r in rows)
    count = sum(len(r) for r in rows)
    if name == "token_mean":
        return total / n_items
    if name == "token_mean_local":
        return total / max(count, 1) * len(rows) / n_seqs
    if name == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows if r) / n_seqs
    return total / (n_seqs * max_len)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_matches_naive_loop_and_ignores_masked_garbage(name):
    gen = torch.Generator().manual_seed(7)
    loss = torch.randn(6, 5, generator=gen)
    mask = torch.rand(6, 5, generator=gen) < 0.6
    mask[2] = False  # an empty row
    out = agg(name, loss, mask, 40, 12, 5)
    torch.testing.assert_close(out, torch.tensor(naive(name, loss, mask, 40, 12, 5)), rtol=1e-5, atol=1e-6)
    garbage = torch.where(mask, loss, torch.full_like(loss, float("nan")))
    torch.testing.assert_close(agg(name, garbage, mask, 40, 12, 5), out)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_sum_over_micro_batches_equals_whole_batch(name):
    gen = torch.Generator().manual_seed(8)
    loss = torch.randn(8, 5, generator=gen)
    mask = torch.rand(8, 5, generator=gen) < 0.7
    n_items = mask.sum()  # a tensor works as well as a float
    whole = agg(name, loss, mask, n_items, 8, 5)
    parts = sum(agg(name, loss[i : i + 2], mask[i : i + 2], n_items, 8, 5) for i in range(0, 8, 2))
    if name == "token_mean_local":  # bnpo: the mean of the micro-batches' local token means
        local = [agg("token_mean", loss[i : i + 2], mask[i : i + 2], mask[i : i + 2].sum(), 8) for i in range(0, 8, 2)]
        whole = torch.stack(local).mean()
    torch.testing.assert_close(parts, whole)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_all_masked_is_zero_not_nan(name):
    out = agg(name, torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool), 0, 0, 0)
    torch.testing.assert_close(out, torch.tensor(0.0))
