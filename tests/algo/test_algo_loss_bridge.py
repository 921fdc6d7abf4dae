"""train/loss.py: config -> algo bridge. Hand values, micro-batch invariance, REINFORCE gradient, masks, keys."""

import math

import pytest
import torch

from grpo_cli.config.algorithm import AlgorithmConfig
from grpo_cli.train.loss import (
    compute_advantages,
    compute_loss,
    compute_process_advantages,
    mismatch_metrics,
    trained_mask,
)

NAN = float("nan")
MISMATCH_KEYS = {
    f"rollout_correction/{n}"
    for n in (
        "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
        "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
        "chi2_seq_geo", "ess", "ess_seq", "is_weight_mean", "clipped_frac",
    )
}
CLIP_KEYS = {"loss", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}


def loss_of(algorithm, logp, mask, adv, *, old=None, ref=None, sampler=None, n_items=None, n_seqs=None, max_len=8):
    return compute_loss(
        logprobs=logp, old_logprobs=old, ref_logprobs=ref, sampler_logprobs=sampler, advantages=adv,
        completion_mask=mask, algorithm=algorithm,
        num_items_in_batch=float(mask.sum()) if n_items is None else n_items,
        num_sequences_in_batch=mask.shape[0] if n_seqs is None else n_seqs, max_completion_length=max_len,
    )


def test_compute_advantages_hand_computed():
    rewards_per_func = torch.tensor([[1.0, NAN], [0.0, 1.0], [NAN, NAN], [2.0, 2.0]])
    adv, rewards = compute_advantages(rewards_per_func, weights=[1.0, 0.5], group_size=2, algorithm=AlgorithmConfig())
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.5, NAN, 3.0]), equal_nan=True)
    # group 0 [1, 0.5]: mean 0.75, std 0.353553; group 1 has one valid reward -> 0.
    torch.testing.assert_close(adv, torch.tensor([0.706907, -0.706907, 0.0, 0.0]), rtol=1e-5, atol=1e-6)
    adv, _ = compute_advantages(rewards_per_func, weights=[1.0, 0.5], group_size=2,
                                algorithm=AlgorithmConfig(loss="dr_grpo"))
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.25, 0.0, 0.0]))


def test_compute_process_advantages_feeds_compute_loss():
    adv = compute_process_advantages(torch.tensor([[1.0, 0.0], [1.0, NAN]]), torch.tensor([[1, 4], [2, 0]]),
                                     group_size=2, num_tokens=5, algorithm=AlgorithmConfig())
    assert adv.shape == (2, 5)
    logp = torch.zeros(2, 5, requires_grad=True)
    loss, _ = loss_of(AlgorithmConfig(), logp, torch.ones(2, 5, dtype=torch.bool), adv)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 10)


def test_compute_loss_hand_computed_with_is_and_kl():
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    algo = AlgorithmConfig(kl={"beta": 0.1})
    ref = logp.detach() + torch.tensor([[0.5, 0.0]])  # k3 = [e^.5 - 1.5, 0] = [0.148721, 0]
    loss, m = loss_of(algo, logp, mask, torch.tensor([1.0]), ref=ref)
    torch.testing.assert_close(loss, torch.tensor((-2.0 + 0.0148721) / 2))  # on-policy: -A per token + 0.1 k3
    torch.testing.assert_close(m["kl"], torch.tensor(0.148721 / 2), rtol=1e-5, atol=1e-6)
    sampler = logp.detach() - torch.tensor([[math.log(2.0), 0.0]])  # rho = [2, 1], truncation at 2 keeps 2
    loss, m = loss_of(algo, logp, mask, torch.tensor([1.0]), ref=ref, sampler=sampler)
    torch.testing.assert_close(loss, torch.tensor((-2.0 - 1.0 + 0.0148721) / 2))
    assert set(m) == CLIP_KEYS | MISMATCH_KEYS | {"kl"}


def random_batch(seed, b=8, t=6, off_policy=True):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen) * 3
    old = logp + 0.2 * torch.randn(b, t, generator=gen) if off_policy else None
    ref = logp + 0.3 * torch.randn(b, t, generator=gen)
    sampler = logp + 0.3 * torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.7
    mask[1] = False
    adv = torch.randn(b, generator=gen)
    return logp, old, ref, sampler, mask, adv


FULL = {"kl": {"beta": 0.05}, "off_policy_sequence_mask_delta": 0.0, "is_correction": {"mode": "token_mask",
                                                                                       "threshold": 1.5}}


@pytest.mark.parametrize("preset", ["dapo", "grpo", "dr_grpo", "gspo"])
def test_micro_batches_sum_to_the_whole_batch(preset):
    algo = AlgorithmConfig(loss=preset, **FULL)
    logp, old, ref, sampler, mask, adv = random_batch(15)
    n_items = float(mask.sum())
    lp = logp.clone().requires_grad_()
    whole, _ = loss_of(algo, lp, mask, adv, old=old, ref=ref, sampler=sampler, n_items=n_items, n_seqs=8)
    whole.backward()
    lp_parts = logp.clone().requires_grad_()
    parts = 0.0
    for i in range(0, 8, 2):
        sl = slice(i, i + 2)
        part, _ = loss_of(algo, lp_parts[sl], mask[sl], adv[sl], old=old[sl], ref=ref[sl], sampler=sampler[sl],
                          n_items=n_items, n_seqs=8)
        parts = parts + part
    parts.backward()
    torch.testing.assert_close(parts, whole)
    torch.testing.assert_close(lp_parts.grad, lp.grad)


@pytest.mark.parametrize("aggregation", ["token_mean", "token_mean_local", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("kind", ["clip", "gspo", "gspo_token", "cispo"])
def test_on_policy_gradient_is_reinforce(aggregation, kind):
    logp, _, _, sampler, mask, adv = random_batch(16, off_policy=False)
    algo = AlgorithmConfig(aggregation=aggregation, objective={"kind": kind})
    lp = logp.clone().requires_grad_()
    loss, _ = loss_of(algo, lp, mask, adv, n_items=30.0, n_seqs=16, max_len=6)
    loss.backward()
    lengths = mask.sum(dim=1, keepdim=True).float().clamp(min=1)
    scale = {
        "token_mean": torch.tensor(1 / 30.0),
        "token_mean_local": 8 / 16 / mask.sum().float(),
        "seq_mean_token_mean": 1 / (16 * lengths),
        "seq_mean_token_sum_norm": torch.tensor(1 / (16 * 6)),
    }[aggregation]
    expected = torch.where(mask, -adv[:, None] * scale, torch.zeros_like(logp))
    torch.testing.assert_close(lp.grad, expected)


def test_masked_garbage_changes_nothing_through_compute_loss():
    algo = AlgorithmConfig(loss="grpo", **FULL)
    logp, old, ref, sampler, mask, adv = random_batch(17)
    outs = []
    for garbage in (0.0, NAN, float("inf")):
        fill = lambda x: torch.where(mask, x, torch.full_like(x, garbage))  # noqa: E731
        lp = fill(logp).requires_grad_()
        loss, metrics = loss_of(algo, lp, mask, adv, old=fill(old), ref=fill(ref), sampler=fill(sampler))
        loss.backward()
        outs.append((loss, lp.grad, metrics))
    for loss, grad, metrics in outs[1:]:
        torch.testing.assert_close(loss, outs[0][0])
        torch.testing.assert_close(grad, outs[0][1])
        for name, value in metrics.items():
            torch.testing.assert_close(value, outs[0][2][name], msg=name)


def test_metric_keys_and_switches():
    logp, old, ref, sampler, mask, adv = random_batch(18)
    _, m = loss_of(AlgorithmConfig(), logp, mask, adv, old=old)
    assert set(m) == CLIP_KEYS
    _, m = loss_of(AlgorithmConfig(is_correction={"enabled": False}), logp, mask, adv, old=old, sampler=sampler)
    assert set(m) == CLIP_KEYS | MISMATCH_KEYS
    _, m = loss_of(AlgorithmConfig(**FULL), logp, mask, adv, old=old, ref=ref, sampler=sampler)
    assert set(m) == CLIP_KEYS | MISMATCH_KEYS | {"kl", "opsm/masked_frac"}
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_of(AlgorithmConfig(kl={"beta": 0.1}), logp, mask, adv)


def test_correction_off_leaves_loss_unchanged_and_sampler_equal_old_is_neutral():
    logp, old, _, sampler, mask, adv = random_batch(19)
    base, _ = loss_of(AlgorithmConfig(), logp, mask, adv, old=old)
    off, _ = loss_of(AlgorithmConfig(is_correction={"enabled": False}), logp, mask, adv, old=old, sampler=sampler)
    same, m = loss_of(AlgorithmConfig(), logp, mask, adv, old=old, sampler=old.clone())
    torch.testing.assert_close(off, base)
    torch.testing.assert_close(same, base)
    torch.testing.assert_close(m["rollout_correction/ess"], torch.tensor(1.0))


def test_opsm_drops_negative_advantage_sequences_only():
    logp = torch.zeros(2, 2, requires_grad=True)
    sampler = torch.full((2, 2), 1.0)  # delta = 1 for both
    algo = AlgorithmConfig(off_policy_sequence_mask_delta=0.5, is_correction={"enabled": False})
    loss, m = loss_of(algo, logp, torch.ones(2, 2, dtype=torch.bool), torch.tensor([1.0, -1.0]), sampler=sampler)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]]))
    torch.testing.assert_close(m["opsm/masked_frac"], torch.tensor(0.5))


def test_mismatch_metrics_bridge():
    _, old, _, sampler, mask, _ = random_batch(20)
    m = mismatch_metrics(old_logprobs=old, sampler_logprobs=sampler, completion_mask=mask.float(),
                         algorithm=AlgorithmConfig())
    assert set(m) == MISMATCH_KEYS
    assert all(torch.isfinite(v) for v in m.values())


def naive_full_loss(lp, old, ref, sampler, mask, adv, n_seqs):
    """clip(0.2, 0.28, dual 3) x token-truncate IS (1.5) x OPSM (delta 0) + 0.05 k3, seq_mean_token_mean; loops."""
    e = lambda x: math.exp(max(-20.0, min(20.0, x)))  # noqa: E731
    total = 0.0
    for row in zip(lp, old, ref, sampler, mask, adv):
        lps, olds, refs, samps, ms, a = row
        valid = [t for t, m in enumerate(ms) if m]
        if not valid:
            continue
        delta = sum(samps[t] - lps[t] for t in valid) / len(valid)
        keep = 0.0 if (a < 0 and delta > 0.0) else 1.0
        seq = 0.0
        for t in valid:
            r = e(lps[t] - olds[t])
            loss = max(-r * a, -min(max(r, 0.8), 1.28) * a)
            if a < 0:
                loss = min(loss, -3.0 * a)
            w = min(e(olds[t] - samps[t]), 1.5)
            x = refs[t] - lps[t]
            seq += w * keep * loss + 0.05 * (e(x) - x - 1)
        total += seq / len(valid)
    return total / n_seqs


def test_compute_loss_matches_naive_loop():
    algo = AlgorithmConfig(
        loss="grpo", objective={"epsilon_high": 0.28, "dual_clip_c": 3.0}, kl={"beta": 0.05},
        is_correction={"threshold": 1.5}, off_policy_sequence_mask_delta=0.0,
    )
    logp, old, ref, sampler, mask, adv = random_batch(22)
    loss, _ = loss_of(algo, logp, mask, adv, old=old, ref=ref, sampler=sampler, n_seqs=8)
    expected = naive_full_loss(*(x.tolist() for x in (logp, old, ref, sampler, mask, adv)), 8)
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_compute_advantages_matches_naive_loop():
    gen = torch.Generator().manual_seed(23)
    r = torch.randn(12, 2, generator=gen)
    r[torch.rand(12, 2, generator=gen) < 0.3] = NAN
    adv, rewards = compute_advantages(r, weights=[1.0, 2.0], group_size=3, algorithm=AlgorithmConfig())
    expected = []
    for g in range(4):
        rows = r[3 * g : 3 * g + 3].tolist()
        totals = [sum(v * w for v, w in zip(row, (1.0, 2.0)) if not math.isnan(v)) if any(
            not math.isnan(v) for v in row) else NAN for row in rows]
        valid = [x for x in totals if not math.isnan(x)]
        mean = sum(valid) / len(valid) if valid else 0.0
        std = math.sqrt(sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)) if len(valid) > 1 else 0.0
        expected += [0.0 if math.isnan(x) else (x - mean) / (std + 1e-4) for x in totals]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_entropy_metric_and_bonus_hand_computed():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, m = compute_loss(logprobs=logp, old_logprobs=None, ref_logprobs=None, sampler_logprobs=None, advantages=adv,
                           completion_mask=mask, algorithm=AlgorithmConfig(), num_items_in_batch=3.0,
                           num_sequences_in_batch=2, max_completion_length=3, entropy=entropy)
    torch.testing.assert_close(m["entropy"], torch.tensor(2.0))  # mean over valid tokens (1, 2, 3)
    torch.testing.assert_close(loss, torch.tensor(-1 / 3))  # on-policy: (-1 - 1 + 1) / 3, no bonus
    algo = AlgorithmConfig(entropy_coef=0.1)
    loss, m = compute_loss(logprobs=logp, old_logprobs=None, ref_logprobs=None, sampler_logprobs=None, advantages=adv,
                           completion_mask=mask, algorithm=algo, num_items_in_batch=3.0,
                           num_sequences_in_batch=2, max_completion_length=3, entropy=entropy)
    torch.testing.assert_close(loss, torch.tensor((-1.0 - 0.6) / 3))  # minus 0.1 * (1 + 2 + 3), token_mean
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.1 / 3, -0.1 / 3, 0.0], [-0.1 / 3, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="entropy"):
        compute_loss(logprobs=logp, old_logprobs=None, ref_logprobs=None, sampler_logprobs=None, advantages=adv,
                     completion_mask=mask, algorithm=algo, num_items_in_batch=3.0, num_sequences_in_batch=2,
                     max_completion_length=3)


def test_mask_truncated_completions_leaves_the_loss_keeps_metrics():
    logp = torch.zeros(2, 2, requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    truncated = torch.tensor([False, True])
    sampler = torch.tensor([[0.0, 0.0], [-0.5, -0.5]])  # only the truncated row has a mismatch
    entropy = torch.tensor([[1.0, 1.0], [3.0, 3.0]])
    algo = AlgorithmConfig(mask_truncated_completions=True)
    trained = trained_mask(mask, truncated, algorithm=algo)
    assert trained.tolist() == [[True, True], [False, False]]
    assert trained_mask(mask, truncated, algorithm=AlgorithmConfig()).all()
    loss, m = compute_loss(logprobs=logp, old_logprobs=None, ref_logprobs=None, sampler_logprobs=sampler,
                           advantages=torch.tensor([1.0, 5.0]), completion_mask=mask, algorithm=algo,
                           num_items_in_batch=float(trained.sum()), num_sequences_in_batch=2, max_completion_length=2,
                           entropy=entropy, truncated=truncated)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-1.0))  # only row 0: token mean of -A over its 2 tokens
    assert (logp.grad[1] == 0).all()
    torch.testing.assert_close(m["entropy"], torch.tensor(2.0))  # the truncated row stays in the metrics
    torch.testing.assert_close(m["rollout_correction/kl"], torch.tensor(-0.25))
