"""Trainer logprobs from packed rows (one prompt copy + its completions, 4D mask) equal one plain padded forward pass
over every row, in values and gradients; the packing bookkeeping and mask are the documented ones."""

from __future__ import annotations

import random

import pytest
import torch

from grpo_cli.models import logprobs as scoring
from grpo_cli.models.packing import packed_mask, plan_packing
from grpo_cli.models.logprobs import completion_logprobs, completion_logprobs_entropy

T = 12


def load(tiny_checkpoint, attn: str):
    """`grpo_sdpa` is what the trainer loads for `model.attn_implementation: sdpa` (structured packed attention)."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.attention import attention_implementation

    attn = attention_implementation("sdpa") if attn == "grpo_sdpa" else attn
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation=attn).train()


def group_batch(prompt_lens=(6, 3, 6, 2), group=8, widths=(1, 2, 3, 4, 12)):
    """[left-padded prompt | right-padded completion] rows, `group` completions per prompt, mixed widths."""
    rng = random.Random(0)
    width = max(prompt_lens)
    ids = torch.zeros(len(prompt_lens) * group, width + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for p, plen in enumerate(prompt_lens):
        prompt = [rng.randrange(6, 60) for _ in range(plen)]
        for j in range(p * group, (p + 1) * group):
            n = rng.choice(widths)
            ids[j, width - plen : width] = torch.tensor(prompt)
            ids[j, width : width + n] = torch.tensor([rng.randrange(6, 60) for _ in range(n)])
            mask[j, width - plen : width + n] = 1
    return ids, mask


def logprobs_and_grads(model, ids, mask, temperature=0.8):
    model.zero_grad(set_to_none=True)
    lp = completion_logprobs(model, ids, mask, logits_to_keep=T, temperature=temperature)
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(fast, ref):
    assert torch.allclose(fast[0], ref[0], atol=1e-5)
    for name, g in ref[1].items():
        assert torch.allclose(fast[1][name], g, atol=1e-6, rtol=1e-4), name


def spy_on_packing(monkeypatch) -> list:
    calls = []

    def spy(*args, **kwargs):
        calls.append(plan_packing(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(scoring, "plan_packing", spy)
    return calls


@pytest.mark.parametrize("attn", ["sdpa", "eager", "grpo_sdpa"])
def test_packed_rows_equal_one_plain_pass(tiny_checkpoint, attn, monkeypatch):
    model, (ids, mask) = load(tiny_checkpoint, attn), group_batch()
    calls = spy_on_packing(monkeypatch)
    fast = logprobs_and_grads(model, ids, mask)
    # a row per prompt under a row-wide mask; grpo_sdpa keeps groups apart by layout: one row of all four
    assert calls and calls[0].src.shape[0] == (1 if attn == "grpo_sdpa" else 4)
    monkeypatch.setattr(scoring, "MIN_SAVING", 2.0)  # packing never pays: one plain pass
    assert_same(fast, logprobs_and_grads(model, ids, mask))
    widths = (mask[:, -T:] * torch.arange(1, T + 1)).amax(1)
    assert (fast[0][torch.arange(T) >= widths[:, None]] == 0).all()  # 0 after each row's last token


def test_long_groups_split_over_rows_and_checkpointing_agree(tiny_checkpoint, monkeypatch):
    model, (ids, mask) = load(tiny_checkpoint, "sdpa"), group_batch()
    monkeypatch.setattr(scoring, "MIN_SAVING", 2.0)
    ref = logprobs_and_grads(model, ids, mask)
    monkeypatch.setattr(scoring, "MIN_SAVING", -10.0)  # pack whatever the cost
    monkeypatch.setattr(scoring, "_packable", lambda model: 8)  # rows of at most max(S, 8) = 18 positions
    calls = spy_on_packing(monkeypatch)
    model.gradient_checkpointing_enable()
    try:
        fast = logprobs_and_grads(model, ids, mask)
    finally:
        model.gradient_checkpointing_disable()
    assert calls[0].src.shape[0] > 4 and calls[0].src.shape[1] <= ids.shape[1]
    assert_same(fast, ref)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_structured_packed_attention_equals_a_plain_pass_with_checkpointing(tmp_path, arch, monkeypatch):
    """grpo_sdpa runs packed rows as prompt + own-completion attention (`packed_attention`), never the row-wide
    N x N mask: a whole group in one row, logits and gradients equal to one plain padded pass, on architectures
    with q/k/v biases and tied embeddings (Qwen2) and q/k norms (Qwen3), with activation checkpointing too (the
    recomputed forward finds the layout on the same mask). All groups share one row, without padding between them."""
    import torch.nn.functional as F

    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = str(build_tiny_checkpoint(tmp_path / arch, arch=arch))
    model, (ids, mask) = load(path, "grpo_sdpa"), group_batch(group=16)
    monkeypatch.setattr(scoring, "MIN_SAVING", 2.0)
    ref = logprobs_and_grads(model, ids, mask)
    monkeypatch.setattr(scoring, "MIN_SAVING", 0.1)
    calls = spy_on_packing(monkeypatch)
    shapes = []
    real_sdpa = F.scaled_dot_product_attention

    def spy_sdpa(q, k, v, **kw):
        shapes.append(tuple(kw["attn_mask"].shape))
        return real_sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    model.gradient_checkpointing_enable()
    try:
        fast = logprobs_and_grads(model, ids, mask)
    finally:
        model.gradient_checkpointing_disable()
    rows, n = calls[0].src.shape
    assert rows == 1 and int((calls[0].src < 0).sum()) == 0  # 64 sequences in one row, no padding between them
    assert shapes and all(s[-1] < n for s in shapes)  # no attention call over the whole row
    assert torch.allclose(fast[0], ref[0], atol=1e-5)
    for name, g in ref[1].items():  # fp32 summation order: both sit ~1e-6·scale from a float64 pass (measured)
        assert (fast[1][name] - g).abs().max() <= 1e-6 * max(1.0, g.abs().max().item()), name


def test_structured_packed_attention_under_bf16_autocast(tiny_checkpoint, monkeypatch):
    """bf16 compute (autocast over float32 weights, where RoPE leaves q/k in float32 and v in bf16): the packed
    pass runs and matches the plain pass to bf16 rounding."""
    model, (ids, mask) = load(tiny_checkpoint, "grpo_sdpa"), group_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        monkeypatch.setattr(scoring, "MIN_SAVING", 2.0)
        ref = logprobs_and_grads(model, ids, mask)
        monkeypatch.setattr(scoring, "MIN_SAVING", 0.1)
        fast = logprobs_and_grads(model, ids, mask)
    assert torch.allclose(fast[0], ref[0], atol=2e-2)
    assert all(torch.isfinite(g).all() for g in fast[1].values())


def test_distinct_full_rows_stay_unpacked(tiny_checkpoint, monkeypatch):
    model = load(tiny_checkpoint, "sdpa")
    ids = torch.randint(6, 60, (4, 3 + T))
    calls = spy_on_packing(monkeypatch)
    with torch.no_grad():
        completion_logprobs(model, ids, torch.ones_like(ids), logits_to_keep=T, temperature=1.0)
    assert calls[0].src.shape == ids.shape  # planned, same cost as the plain batch: not used


def test_plan_and_mask_of_a_small_batch():
    #            prompt (left-padded) | completion
    ids = torch.tensor([[0, 7, 8, 20, 21, 0],
                        [0, 7, 8, 30, 0, 0],
                        [9, 9, 9, 40, 41, 42]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0],
                         [0, 1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 1, 1]])
    p = plan_packing(ids, mask, 3, max_row=16)
    flat = ids.reshape(-1)
    packed = torch.where(p.src >= 0, flat[p.src.clamp(min=0)], -1)
    assert sorted(packed.tolist()) == sorted([[0, 7, 8, 20, 21, 30], [9, 9, 9, 40, 41, 42]])
    row_a = [r for r in range(2) if packed[r, 0] == 0][0]
    assert p.segment[row_a].tolist() == [0, 0, 0, 1, 1, 2]
    assert p.row[0] == p.row[1] == row_a and p.pos[0].tolist() == [2, 3, 5] and p.pos[1, 0] == 2
    valid = mask.reshape(-1)[p.src.clamp(min=0)] * (p.src >= 0)
    assert p.prompt_start.tolist() == [0, 0, 0]
    m = packed_mask(p, valid)[row_a, 0]
    assert m[5].tolist() == [False, True, True, False, False, True]  # 2nd completion: prompt + itself, not the 1st
    assert m[4].tolist() == [False, True, True, True, True, False]
    assert m[0].tolist() == [True, False, False, False, False, False]  # padding sees only itself
    one = plan_packing(ids, mask, 3, max_row=None)  # one row: each prompt, then its completions
    packed = flat[one.src[0]].tolist()
    assert one.src.shape == (1, 12) and sorted([packed[:6], packed[6:]]) == [[0, 7, 8, 20, 21, 30],
                                                                           [9, 9, 9, 40, 41, 42]]
    a = 0 if packed[0] == 0 else 6  # where the shared prompt of sequences 0 and 1 begins
    assert one.prompt_start.tolist() == [a, a, 6 - a] and one.start.tolist() == [a + 3, a + 5, 9 - a]
    assert one.pos[0].tolist() == [a + 2, a + 3, 11] and one.pos[2].tolist() == [8 - a, 9 - a, 10 - a]


def test_entropy_from_the_same_forward_equals_a_full_softmax(tiny_checkpoint):
    """completion_logprobs_entropy: same logprobs as completion_logprobs; entropy equals -sum p log p of the
    tempered full softmax at each completion position; its gradient reaches the model only with entropy_grad."""
    model, (ids, mask) = load(tiny_checkpoint, "sdpa"), group_batch()
    lp, h = completion_logprobs_entropy(model, ids, mask, logits_to_keep=T, temperature=0.8, entropy_grad=True)
    torch.testing.assert_close(lp, completion_logprobs(model, ids, mask, logits_to_keep=T, temperature=0.8))
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -T - 1 : -1].double() / 0.8
        ref = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    widths = (mask[:, -T:] * torch.arange(1, T + 1)).amax(1)
    valid = torch.arange(T) < widths[:, None]
    torch.testing.assert_close(h[valid].double(), ref[valid], rtol=1e-4, atol=1e-5)
    assert (h[~valid] == 0).all() and h.requires_grad
    _, h = completion_logprobs_entropy(model, ids, mask, logits_to_keep=T, temperature=0.8, entropy_grad=False)
    assert not h.requires_grad


def test_sliding_window_rows_run_padded_with_the_window(tmp_path, monkeypatch):
    """A model with sliding-window layers (the tiny Mistral, window `SLIDING_WINDOW`) never runs packed: the window
    would count packed positions. Its padded rows, longer than the window, get the logprobs of transformers' own
    eager attention with its sliding mask, which differ from full attention's past the window."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import SLIDING_WINDOW, build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "mistral", arch="mistral")
    steps = SLIDING_WINDOW + 16
    ids = torch.randint(6, 60, (4, 8 + steps), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8 + steps // 2 :] = 0  # a shorter completion: right padding the packing would otherwise remove
    keep = mask[:, 8:].bool()
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                sliding_window=None)
    with torch.no_grad():
        unwindowed = completion_logprobs(full, ids, mask, logits_to_keep=steps, temperature=1.0)
        calls = spy_on_packing(monkeypatch)
        fast, ref = (completion_logprobs(load(path, attn), ids, mask, logits_to_keep=steps, temperature=1.0)
                     for attn in ("grpo_sdpa", "eager"))
    assert calls == []
    assert torch.allclose(fast[keep], ref[keep], atol=1e-5)
    assert not torch.allclose(ref[:, -8:], unwindowed[:, -8:], atol=1e-3)  # the window is in force
