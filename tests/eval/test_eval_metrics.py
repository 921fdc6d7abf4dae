"""Evaluation metrics from scored completions, and the built-in tasks' held-out split."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.config.sections import EvalConfig
from grpo_cli.data.sources import DataError, load_rows
from grpo_cli.train.eval_metrics import local_sums, reduce_means
from grpo_cli.rewards.resolve import RewardFn
from grpo_cli.runtime.dist import DistInfo


def _fn(name: str, weight: float, **kw) -> RewardFn:
    return RewardFn(name=name, fn=lambda **_: [], weight=weight, kwargs={}, **kw)


def test_eval_metrics_by_hand():
    # 2 prompts × G = 2; functions a (weight 1) and b (weight 2); one missing score of b.
    per_func = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, float("nan")]])
    cfg = EvalConfig(pass_threshold=1.0)
    sums = local_sums(cfg, per_func=per_func, reward_fns=[_fn("a", 1.0), _fn("b", 2.0)],
                      completion_ids=[[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]], group_size=2)
    out = reduce_means(sums, DistInfo())
    # rewards: 1, 0, 3, 0 → mean 1; correct (≥ 1): prompt 0 has 1 of 2, prompt 1 has 1 of 2.
    assert out["eval/reward/mean"] == 1.0
    assert out["eval/reward/a/mean"] == 0.5 and out["eval/reward/b/mean"] == pytest.approx(1 / 3)
    assert out["eval/pass@1"] == 0.5 and out["eval/pass@2"] == 1.0
    assert out["eval/completions/mean_length"] == 2.5


def test_eval_metrics_can_be_chosen():
    cfg = EvalConfig(metrics=["reward"])
    sums = local_sums(cfg, per_func=torch.zeros(4, 1), reward_fns=[_fn("a", 1.0)], completion_ids=[[1]] * 4,
                      group_size=4)
    assert set(reduce_means(sums, DistInfo())) == {"eval/reward/mean"}
    assert math.isnan(reduce_means({"x": (0.0, 0.0)}, DistInfo())["x"])


def test_eval_and_training_label_a_reward_file_function_alike(tmp_path):
    """A function given as /abs/path/rw.py:mine is `eval/reward/mine/mean` (was `eval//abs/path/rw.py:mine/mean`):
    `eval/` + training's `reward/mine/mean`; an alias wins in both."""
    from types import SimpleNamespace

    from grpo_cli.train.scoring.rewards_phase import reward_metrics

    fns = [_fn(f"{tmp_path}/rw.py:mine", 1.0), _fn("length", 1.0, label="short")]
    per_func = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    evaluated = reduce_means(local_sums(EvalConfig(metrics=["per_function"]), per_func=per_func, reward_fns=fns,
                                        completion_ids=[[1], [2]], group_size=2), DistInfo())
    assert set(evaluated) == {"eval/reward/mine/mean", "eval/reward/short/mean"}
    scored = SimpleNamespace(per_func=per_func, errors=0,
                             rollout=SimpleNamespace(completion_ids=[[1], [2]], finish_reasons=["stop", "stop"]))
    trained = reward_metrics(SimpleNamespace(train=SimpleNamespace(generations_per_prompt=2)), fns, scored)
    assert {k for k in trained if k.count("/") == 2 and k.endswith("/mean")} == {"reward/mine/mean",
                                                                                  "reward/short/mean"}
    assert {f"eval/{k}" for k in trained if k.count("/") == 2} == set(evaluated)


def test_a_function_named_reward_keeps_apart_from_the_weighted_total(tmp_path):
    """`rw.py:reward` (weight 1) beside `length` (weight 2): the weighted total stays `eval/reward/mean` (was
    overwritten by the function's own mean, `eval/reward/mean` too)."""
    fns = [_fn(f"{tmp_path}/rw.py:reward", 1.0), _fn("length", 2.0)]
    per_func = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = reduce_means(local_sums(EvalConfig(metrics=["reward", "per_function"]), per_func=per_func,
                                  reward_fns=fns, completion_ids=[[1], [2]], group_size=2), DistInfo())
    assert out == {"eval/reward/mean": 1.5, "eval/reward/reward/mean": 0.5, "eval/reward/length/mean": 0.5}


@pytest.mark.parametrize("task", ["words", "arith"])
def test_builtin_heldout_split_never_appears_in_training(task):
    text = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    train, held = text(load_rows(f"builtin:{task}", seed=0)), text(load_rows(f"builtin:{task}:heldout", seed=0))
    assert held and train and not (train & held)
    with pytest.raises(DataError, match="heldout"):
        load_rows(f"builtin:{task}:test")
