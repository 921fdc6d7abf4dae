"""Property tests (hypothesis): finite inputs of random shapes and masks never give NaN/inf, all-masked rows too."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_cli.algo.advantages import group_advantages, process_advantages
from grpo_cli.config.algorithm import AlgorithmConfig
from grpo_cli.train.loss import compute_loss

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None)


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.0, 0.5, 5.0, 40.0]))  # 40: log-ratios far beyond the ±20 clamp
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)))
    if draw(st.booleans()):
        mask[0] = False  # an all-masked row
    logp = -torch.rand(b, t, generator=gen) * 30
    noise = lambda: spread * torch.randn(b, t, generator=gen)  # noqa: E731
    adv_shape = (b,) if draw(st.booleans()) else (b, t)
    adv = torch.randn(adv_shape, generator=gen) * draw(st.sampled_from([0.0, 1.0, 1e3]))
    return logp, logp + noise(), logp + noise(), logp + noise(), mask, adv


@st.composite
def algorithms(draw):
    kind = draw(st.sampled_from(["clip", "gspo", "gspo_token", "cispo"]))
    return AlgorithmConfig(
        aggregation=draw(st.sampled_from(["token_mean", "token_mean_local", "seq_mean_token_mean",
                                          "seq_mean_token_sum_norm"])),
        objective={"kind": kind, "dual_clip_c": None if kind == "cispo" else draw(st.sampled_from([None, 3.0]))},
        kl={"beta": draw(st.sampled_from([0.0, 0.1])), "estimator": draw(st.sampled_from(["k1", "k2", "k3"]))},
        is_correction={
            "enabled": draw(st.booleans()),
            "level": draw(st.sampled_from(["token", "sequence_product", "sequence_geometric"])),
            "action": draw(st.sampled_from(["truncate", "mask"])),
        },
        off_policy_sequence_mask_delta=draw(st.sampled_from([None, 0.0, 0.5])),
    )


@SETTINGS
@given(batch=batches(), algorithm=algorithms(), with_sampler=st.booleans())
def test_compute_loss_is_finite(batch, algorithm, with_sampler):
    logp, old, ref, sampler, mask, adv = batch
    lp = logp.clone().requires_grad_()
    loss, metrics = compute_loss(
        logprobs=lp, old_logprobs=old, ref_logprobs=ref, sampler_logprobs=sampler if with_sampler else None,
        advantages=adv, completion_mask=mask, algorithm=algorithm, num_items_in_batch=float(mask.sum()),
        num_sequences_in_batch=mask.shape[0], max_completion_length=mask.shape[1],
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask] == 0).all()
    for name, value in metrics.items():
        assert torch.isfinite(value), name


@SETTINGS
@given(
    groups=st.integers(1, 4),
    group_size=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    nan_frac=st.sampled_from([0.0, 0.3, 1.0]),
    scale_rewards=st.sampled_from(["group", "batch", "none"]),
    magnitude=st.sampled_from([1e-6, 1.0, 1e6]),
)
def test_advantages_are_finite(groups, group_size, seed, nan_frac, scale_rewards, magnitude):
    gen = torch.Generator().manual_seed(seed)
    b = groups * group_size
    rewards = torch.randn(b, generator=gen) * magnitude
    rewards[torch.rand(b, generator=gen) < nan_frac] = float("nan")
    adv = group_advantages(rewards, group_size, estimator="grpo", scale_rewards=scale_rewards, epsilon=1e-4)
    assert torch.isfinite(adv).all()
    assert (adv[torch.isnan(rewards)] == 0).all()
    steps = torch.randn(b, 3, generator=gen) * magnitude
    steps[torch.rand(b, 3, generator=gen) < nan_frac] = float("nan")
    ends = torch.randint(0, 4, (b, 3), generator=gen)
    assert torch.isfinite(process_advantages(steps, ends, group_size, 4, estimator="grpo", scale_rewards=scale_rewards,
                                             epsilon=1e-4)).all()
