"""Process (step) rewards: steps split on the separator, step ends placed on tokens, (B, T) advantages equal to
`process_advantages` on the hand-built step table (an outcome reward is a step at the last token)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from grpo_cli.algo.advantages import process_advantages
from grpo_cli.config.load import build_config
from grpo_cli.data.prompts import Prompt
from grpo_cli.rewards.process import split_steps, step_end_tokens
from grpo_cli.rewards.resolve import RewardError, build_reward_fns
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.scoring.rewards_phase import reward_step, score_rollout

STEP_FN = """
def cat_steps(prompts, completions, *, steps, **_):
    return [[1.0 if "cat" in s else (None if "yes" in s else 0.0) for s in row] for row in steps]

def wrong(prompts, completions, *, steps, **_):
    return [[1.0] for _ in completions]
"""


def test_split_steps_keeps_the_separator_with_its_step_and_drops_blank_steps():
    assert split_steps("a b. c.. d", ".") == (["a b", " c", " d"], [4, 7, 10])
    assert split_steps("no separator", ".") == (["no separator"], [12])


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def test_step_ends_land_on_the_separator_token(tokenizer):
    ids = tokenizer("the cat . say words . yes", add_special_tokens=False)["input_ids"]
    _, char_ends = split_steps(tokenizer.decode(ids), ".")
    assert step_end_tokens(lambda x: tokenizer.decode(x), ids, char_ends) == [2, 5, 6]


def _config(tmp_path, functions):
    (tmp_path / "steps.py").write_text(STEP_FN)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"rewards": {"functions": functions, "step_separator": "."}}))
    return build_config("tiny-cpu", path, ["train.prompts_per_step=1", "train.generations_per_prompt=2",
                                           "train.micro_batch_size=2"])


def test_process_and_outcome_rewards_give_token_advantages(tmp_path, tokenizer):
    cfg = _config(tmp_path, [{"name": f"{tmp_path}/steps.py:cat_steps", "kind": "process"},
                             {"name": "length", "kwargs": {"target": 3}, "weight": 0.5}])
    texts = ["the cat . say words . yes", "the dog . the cat"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rollout = RolloutBatch(prompt_ids=[[1]], completion_ids=ids, finish_reasons=["stop", "stop"])
    fns = build_reward_fns(cfg.rewards.functions)
    scored = score_rollout(cfg, fns, tokenizer, [Prompt("p", [1], {})], rollout)
    assert scored.completions == texts
    advantages, rewards, metrics = reward_step(cfg, fns, scored)
    # completion 0: steps "the cat ." (1.0, ends at token 2), " say words ." (0.0, token 5), " yes" (None);
    # length reward -|3 - 7| = -4 at its last token 6, weight 0.5. Completion 1: "the dog ." (0.0, token 2),
    # " the cat" (1.0, token 4); length -|3 - 5| = -2 at token 4.
    nan = math.nan
    want = process_advantages(torch.tensor([[1.0, 0.0, nan, -2.0], [0.0, 1.0, -1.0, nan]]),
                              torch.tensor([[2, 5, 6, 6], [2, 4, 4, 0]]), 2, 7,
                              **cfg.algorithm.advantage.model_dump())
    assert advantages.shape == (2, 7)
    torch.testing.assert_close(advantages, want)
    assert advantages[1, 5:].abs().sum() == 0  # nothing after the last step
    assert metrics["reward/cat_steps/mean"] == pytest.approx((0.5 + 0.5) / 2)
    torch.testing.assert_close(rewards, torch.tensor([0.5 - 2.0, 0.5 - 1.0]))


def test_wrong_step_count_names_the_function(tmp_path, tokenizer):
    cfg = _config(tmp_path, [{"name": f"{tmp_path}/steps.py:wrong", "kind": "process"}])
    texts = ["the cat . yes", "the dog"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rollout = RolloutBatch(prompt_ids=[[1]], completion_ids=ids, finish_reasons=["stop", "stop"])
    with pytest.raises(RewardError, match="process reward .*wrong.* which has 2 steps"):
        score_rollout(cfg, build_reward_fns(cfg.rewards.functions), tokenizer, [Prompt("p", [1], {})], rollout)


def test_step_rewards_keep_their_rows_through_dynamic_sampling():
    from grpo_cli.train.scoring.step_rewards import StepRewards

    s = StepRewards(values=[[[1.0], [2.0, 3.0], [4.0]]], ends=[[0], [0, 1], [2]], last=[0, 1, 2])
    kept = s.rows([2, 1])
    assert kept == StepRewards([[[4.0], [2.0, 3.0]]], [[2], [0, 1]], [2, 1])
    assert StepRewards.cat([s.rows([0]), kept]) == StepRewards([[[1.0], [4.0], [2.0, 3.0]]], [[0], [2], [0, 1]],
                                                                [0, 2, 1])
