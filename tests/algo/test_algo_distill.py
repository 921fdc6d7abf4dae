"""On-policy distillation math (`algo/distill.py`) against a float64 by-hand loop: masks, the clip, both modes,
sequence and per-token advantages, all-masked rows, |log-ratio| > 20, non-finite scores, the metrics."""

import pytest
import torch

from grpo_cli.algo.distill import distill_advantages, distill_metrics, distill_signal


def by_hand(student, teacher, mask, adv, *, coef, clip, mode):
    """(signal, advantages, reverse_kl, teacher mean, clipped share, advantage share), float64 Python loops."""
    b, t = len(mask), len(mask[0])
    sig = [[0.0] * t for _ in range(b)]
    out = [[0.0] * t for _ in range(b)]
    xs, ts, dense, reward = [], [], 0.0, 0.0
    for i in range(b):
        for k in range(t):
            if not mask[i][k]:
                continue
            x = float(student[i][k]) - float(teacher[i][k])
            s = -min(max(x, -clip), clip)
            a = adv[i] if not isinstance(adv[i], list) else adv[i][k]
            sig[i][k] = s
            out[i][k] = (a if mode == "add" else 0.0) + coef * s
            xs.append(x)
            ts.append(float(teacher[i][k]))
            dense += abs(coef * s)
            reward += abs(a) if mode == "add" else 0.0
    n = max(len(xs), 1)
    share = dense / (dense + reward) if dense + reward > 0 else 0.0
    return (sig, out, sum(xs) / n, sum(ts) / n, sum(abs(x) > clip for x in xs) / n, share)


def run(student, teacher, mask, adv, *, coef, clip, mode):
    sig = distill_signal(student, teacher, mask, clip=clip)
    out = distill_advantages(adv, sig, mask, coef=coef, mode=mode)
    m = distill_metrics(student, teacher, mask, advantages=adv, signal=sig, coef=coef, mode=mode, clip=clip)
    return sig, out, m


def check(student, teacher, mask, adv, *, coef, clip, mode):
    sig, out, m = run(student, teacher, mask, adv, coef=coef, clip=clip, mode=mode)
    e_sig, e_out, e_kl, e_t, e_clip, e_share = by_hand(
        student.double().tolist(), teacher.double().tolist(), mask.tolist(), adv.double().tolist(), coef=coef,
        clip=clip, mode=mode)
    torch.testing.assert_close(sig.double(), torch.tensor(e_sig, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), torch.tensor(e_out, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    for name, want in (("reverse_kl", e_kl), ("teacher_logprob", e_t), ("clipped_frac", e_clip),
                       ("advantage_share", e_share)):
        assert float(m[name]) == pytest.approx(want, rel=1e-5, abs=1e-6), name
    return sig, out, m


@pytest.mark.parametrize("mode", ["add", "replace"])
@pytest.mark.parametrize("token_level", [False, True])
def test_matches_float64_by_hand_with_masks_and_clip(mode, token_level):
    gen = torch.Generator().manual_seed(40)
    student = -torch.rand(5, 7, generator=gen) * 30  # |x| up to 30: well past the clip and past 20
    teacher = -torch.rand(5, 7, generator=gen) * 30
    mask = torch.rand(5, 7, generator=gen) < 0.7
    mask[2] = False  # an all-masked row
    adv = torch.randn(5, 7, generator=gen) if token_level else torch.randn(5, generator=gen)
    sig, out, m = check(student, teacher, mask, adv, coef=0.3, clip=2.5, mode=mode)
    assert 0 < float(m["clipped_frac"]) < 1  # the clip acted on some tokens, not all
    assert not out[2].any() and not sig[2].any()  # the all-masked row contributes nothing
    assert not out[~mask].any()


def test_log_ratio_beyond_20_is_clipped_not_overflowed():
    student = torch.tensor([[-0.1, -60.0, -1.0]])
    teacher = torch.tensor([[-45.0, -0.5, -1.0]])  # x = 44.9, -59.5, 0
    mask = torch.ones(1, 3, dtype=torch.bool)
    sig, out, m = check(student, teacher, mask, torch.tensor([0.5]), coef=1.0, clip=10.0, mode="add")
    torch.testing.assert_close(sig, torch.tensor([[-10.0, 10.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[-9.5, 10.5, 0.5]]))
    assert float(m["reverse_kl"]) == pytest.approx((44.9 - 59.5) / 3, rel=1e-5)  # the metric is unclipped
    check(student, teacher, mask, torch.tensor([0.5]), coef=1.0, clip=100.0, mode="add")  # clip above |x|: none


def test_student_equal_to_teacher_gives_exactly_zero_signal():
    gen = torch.Generator().manual_seed(41)
    lp = -torch.rand(4, 6, generator=gen) * 8
    mask = torch.rand(4, 6, generator=gen) < 0.8
    adv = torch.randn(4, generator=gen)
    sig, out, m = run(lp, lp.clone(), mask, adv, coef=2.0, clip=5.0, mode="add")
    assert not sig.any() and float(m["reverse_kl"]) == 0.0 and float(m["advantage_share"]) == 0.0
    assert torch.equal(out, torch.where(mask, adv.unsqueeze(1).expand(4, 6), torch.zeros(())))


def test_all_masked_batch_and_non_finite_scores():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    _, out, m = check(torch.full((2, 3), float("nan")), torch.zeros(2, 3), mask, torch.ones(2), coef=1.0, clip=1.0,
                      mode="add")
    assert not out.any() and all(float(v) == 0.0 for v in m.values())
    mask[0, 1] = True
    with pytest.raises(ValueError, match="student - teacher"):
        distill_signal(torch.zeros(2, 3), torch.full((2, 3), float("-inf")), mask, clip=1.0)


def test_signal_is_detached_and_mode_checked():
    student = torch.zeros(1, 2, requires_grad=True)
    sig = distill_signal(student, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), clip=3.0)
    assert not sig.requires_grad
    with pytest.raises(ValueError, match="add' or 'replace"):
        distill_advantages(torch.zeros(1), sig, torch.ones(1, 2, dtype=torch.bool), coef=1.0, mode="sum")
