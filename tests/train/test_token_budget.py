"""`train.micro_batch_tokens` (issue 37, item 2): rows grouped by a token budget, each micro-batch cut to its own
padding. The loss and its gradients equal one big batch's for every loss type (the aggregation's normalisers count
the whole step), logprobs come back in the batch's row order, every rank runs the same number of micro-batches, and
the rules refuse what a budget cannot serve."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.backends.base import TrainingBackend
from grpo_cli.train.batch import build_batch, micro_batch_rows, packed_token_groups, split_to, token_groups
from grpo_cli.train.loss import compute_loss

BASE = ["data.max_prompt_length=8", "rollout.max_completion_length=20", "train.prompts_per_step=2",
        "train.generations_per_prompt=4", "train.micro_batch_size=8"]
BUDGET = 30  # 1-4 rows of the batch below per micro-batch (padded or packed): micro-batches of different sizes


def _model(attn: str = "sdpa"):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0)
    config._attn_implementation = attn
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _batch():
    """2 prompts (3 and 6 tokens) × 4 completions of 2 to 20 tokens (10×), lengths out of order."""
    g = torch.Generator().manual_seed(1)
    lengths = [20, 2, 9, 4, 3, 17, 2, 11]
    rollout = RolloutBatch(
        prompt_ids=[[5, 6, 7], [8, 9, 10, 11, 12, 13]],
        completion_ids=[torch.randint(1, 50, (n,), generator=g).tolist() for n in lengths],
        finish_reasons=["length" if n == 20 else "stop" for n in lengths])
    batch = build_batch(rollout, group_size=4, pad_token_id=0)
    batch.advantages = torch.randn(len(lengths), generator=g)
    return batch


def _backend(overrides: list[str], model) -> TrainingBackend:
    backend = TrainingBackend(build_config(overrides=[*BASE, *overrides]), DistInfo(), torch.device("cpu"))
    backend.model = backend.module = model
    return backend


def _step(backend: TrainingBackend, batch):
    """What `optimizer_step` runs before clipping: the summed loss and the accumulated gradients."""
    cfg = backend.cfg
    num_items = float(batch.completion_mask.sum())

    def loss_fn(mb, logprobs, entropy):
        return compute_loss(
            logprobs=logprobs, old_logprobs=mb.old_logprobs, ref_logprobs=mb.ref_logprobs,
            sampler_logprobs=mb.sampler_logprobs, advantages=mb.advantages, completion_mask=mb.completion_mask,
            algorithm=cfg.algorithm, num_items_in_batch=num_items, num_sequences_in_batch=len(batch),
            max_completion_length=cfg.rollout.max_completion_length, entropy=entropy, truncated=mb.truncated)

    backend.model.zero_grad(set_to_none=True)
    per_micro = backend.forward_backward(batch, micro_batch_size=cfg.train.micro_batch_size, temperature=0.9,
                                         entropy_grad=cfg.algorithm.entropy_coef > 0, loss_fn=loss_fn)
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()}
    return sum(float(m["loss"]) for m in per_micro), grads, len(per_micro)


LOSSES = [
    ["algorithm.loss=grpo"], ["algorithm.loss=dapo"], ["algorithm.loss=dr_grpo"], ["algorithm.loss=gspo"],
    ["algorithm.objective.kind=cispo", "algorithm.aggregation=token_mean"],
    ["algorithm.aggregation=token_mean"], ["algorithm.aggregation=seq_mean_token_mean"],
    ["algorithm.aggregation=seq_mean_token_sum_norm"],
    # off-policy ratios, KL to a reference, the entropy bonus and masked truncations: all per token or per row
    ["algorithm.loss=dapo", "algorithm.kl.beta=0.1", "algorithm.entropy_coef=0.01",
     "algorithm.mask_truncated_completions=true"],
]


@pytest.mark.parametrize("overrides", LOSSES, ids=lambda o: ",".join(s.split(".", 1)[1] for s in o))
def test_gradients_equal_one_big_batch(overrides):
    model, batch = _model(), _batch()
    whole = _backend(overrides, model)
    old = whole.batch_logprobs(batch, micro_batch_size=8, temperature=0.9)
    g = torch.Generator().manual_seed(2)
    batch.old_logprobs = (old + 0.3 * torch.randn(old.shape, generator=g)) * batch.completion_mask
    batch.ref_logprobs = (old + 0.2 * torch.randn(old.shape, generator=g)) * batch.completion_mask
    loss, grads, n = _step(whole, batch)
    assert n == 1
    budgeted = _backend([*overrides, f"train.micro_batch_tokens={BUDGET}"], model)
    loss_b, grads_b, n_b = _step(budgeted, batch)
    assert n_b >= 3
    assert loss_b == pytest.approx(loss, abs=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_b[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logprobs_come_back_in_row_order(attn):
    model, batch = _model(attn), _batch()
    today = _backend([], model).batch_logprobs(batch, micro_batch_size=2, temperature=1.0)
    budgeted = _backend([f"train.micro_batch_tokens={BUDGET}"], model).batch_logprobs(
        batch, micro_batch_size=2, temperature=1.0)
    assert budgeted.shape == today.shape
    torch.testing.assert_close(budgeted, today, atol=1e-6, rtol=1e-5)


def test_micro_batches_are_cut_to_their_own_padding():
    batch = _batch()
    rows = micro_batch_rows(batch, micro_batch_size=8, micro_batch_tokens=BUDGET)
    assert sorted(r for g in rows for r in g) == list(range(8))
    assert rows[0] == [0]  # the longest row (3 + 20) first, alone: a second row would pass 30 positions
    for group in rows:
        mb = batch.select(group)
        widths = (mb.attention_mask[:, -mb.num_completion_tokens:]).sum(1)
        assert mb.num_completion_tokens == int(widths.max())
        assert mb.attention_mask[:, 0].any()  # no column of padding only on the left
        assert len(mb) * mb.input_ids.shape[1] <= BUDGET
    # the default keeps today's cut: consecutive runs of micro_batch_size rows
    assert micro_batch_rows(batch, micro_batch_size=3, micro_batch_tokens=None) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_token_groups_and_split_to():
    assert token_groups([2, 2, 2, 2], [8, 1, 8, 1], 20) == [[0, 2], [1, 3]]
    assert token_groups([2], [30], 10) == [[0]]  # longer than the budget: alone
    groups = split_to([[0, 1, 2, 3], [4]], 4)
    assert len(groups) == 4 and sorted(r for g in groups for r in g) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="cannot make 3 micro-batches"):
        split_to([[0], [1]], 3)


def test_packed_micro_batches_keep_prompt_groups_whole():
    """Rows that run packed are cut by packed positions — (prompts) × (longest prompt) + Σ completion widths — so a
    group stays whole where it fits (its prompt computed once), and is cut only when larger than the budget."""
    assert packed_token_groups([2, 2, 2, 2], [8, 1, 8, 1], [[0, 1], [2, 3]], 20) == [[0, 1], [2, 3]]  # 2·2 + 18 > 20
    assert packed_token_groups([2, 2, 2, 2], [8, 1, 8, 1], [[0, 1], [2, 3]], 22) == [[0, 1, 2, 3]]
    assert packed_token_groups([2], [30], [[0]], 10) == [[0]]  # longer than the budget: alone
    # a long shared prompt: row by row cuts (`token_groups`) would copy it into every micro-batch
    prompt, width, group = [256] * 8, [100, 20, 50, 128, 10, 90, 60, 30], [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert packed_token_groups(prompt, width, group, 700) == [[3, 0, 2, 1], [5, 6, 7, 4]]
    # too large for 500: the first group is cut in two pieces (each with a prompt copy); the second goes whole
    assert packed_token_groups(prompt, width, group, 500) == [[3, 0], [5, 6, 7, 4], [2, 1]]
    batch = _batch()
    rows = micro_batch_rows(batch, micro_batch_size=8, micro_batch_tokens=BUDGET, packed=True)
    assert sorted(r for g in rows for r in g) == list(range(8))
    prompt_len = batch.input_ids.shape[1] - batch.num_completion_tokens
    for group in rows:
        mb = batch.select(group)
        width = mb.attention_mask[:, -mb.num_completion_tokens:].sum(1)
        prompts = {tuple(r) for r in batch.input_ids[group, :prompt_len].tolist()}
        assert len(group) == 1 or len(prompts) * (mb.input_ids.shape[1] - mb.num_completion_tokens) \
            + int(width.sum()) <= BUDGET


def test_ranks_agree_on_the_count():
    """`agree` gives the largest count of any rank (an all-reduce in the backend); a rank with fewer splits."""
    batch = _batch()
    mine = micro_batch_rows(batch, micro_batch_size=8, micro_batch_tokens=BUDGET)
    agreed = micro_batch_rows(batch, micro_batch_size=8, micro_batch_tokens=BUDGET, agree=lambda n: n + 2)
    assert len(agreed) == len(mine) + 2
    assert sorted(r for g in agreed for r in g) == list(range(8))


@pytest.mark.parametrize(("overrides", "match"), [
    (["train.micro_batch_tokens=27"], r"micro_batch_tokens=27 is smaller than the longest sequence .* = 28"),
    (["train.micro_batch_tokens=64", "distributed.backend=megatron", "rollout.engine=vllm",
      "train.micro_batch_size=1"], r"micro_batch_tokens is not available with distributed\.backend 'megatron'"),
    (["train.micro_batch_tokens=64", "algorithm.loss=bnpo"], r"token_mean_local"),
])
def test_rules(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=[*BASE, *overrides])


def test_micro_batch_size_is_not_checked_under_a_budget():
    """The budget cuts the micro-batches, so a micro_batch_size that divides nothing is no error there (it still is
    without the budget); the plan's rows are the budget's worst case: 64 // 28 = 2 rows of the longest sequence,
    4 micro-batches for the 8 sequences."""
    from grpo_cli.planner.plan import batch_plan

    with pytest.raises(ConfigError, match="micro_batch_size=3 does not divide"):
        build_config(overrides=[*BASE, "train.micro_batch_size=3"])
    cfg = build_config(overrides=[*BASE, "train.micro_batch_size=3", "train.micro_batch_tokens=64"])
    plan = batch_plan(cfg)
    assert (plan["micro_batch_size"], plan["gradient_accumulation"]) == (2, 4)


def test_the_cli_refuses_a_budget_below_the_longest_sequence():
    args = [a for s in [*BASE, "train.micro_batch_tokens=10"] for a in ("--set", s)]
    result = CliRunner().invoke(app, ["train", *args, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "train.micro_batch_tokens=10" in " ".join(result.output.split())


def test_plan_sizes_the_budget():
    """The activations row counts the budget's positions; the largest budget that fits is the last multiple of 256
    positions whose peak fits `--gpu-mem` less the headroom."""
    from grpo_cli.planner.plan import GPU_HEADROOM, GIB, memory_plan, peak_bytes
    from grpo_cli.planner.plan_render import render_plan
    from grpo_cli.planner.plan_tokens import GRANULE, activation_bytes_per_position
    from grpo_cli.config.model_shape import model_shape

    rows = build_config(overrides=BASE)
    budget = build_config(overrides=[*BASE, "train.micro_batch_tokens=1024"])
    per = activation_bytes_per_position(budget, model_shape(budget.model.name_or_path))
    assert memory_plan(rows, None)["activations"] == 8 * 28 * per  # micro_batch_size x longest sequence
    assert memory_plan(budget, None)["activations"] == 1024 * per
    gpu = 0.05 * GIB
    text = render_plan(budget, gpu_mem=gpu)
    assert "micro_batch_tokens           1024" in text and "same_memory_as_rows          224 " in text
    largest = int(text.split("largest_that_fits")[1].split()[0])
    mem = memory_plan(budget, gpu)

    def fits(n):
        return peak_bytes(budget, mem | {"activations": n * per}) <= gpu * (1 - GPU_HEADROOM)

    assert largest % GRANULE == 0 and fits(largest) and not fits(largest + GRANULE)
