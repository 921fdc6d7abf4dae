"""Reward metric names: the function's name or its alias, never a path; shared names say so."""

from __future__ import annotations

import pytest
import yaml

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import build_config
from grpo_cli.data.prompts import Prompt
from grpo_cli.rewards.resolve import build_reward_fns
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.scoring.rewards_phase import reward_step, score_rollout

SOURCE = "def score(prompts, completions, **_):\n    return [float(len(c)) for c in completions]\n"


def _config(tmp_path, functions: list[dict]):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"rewards": {"functions": functions}}))
    return build_config("tiny-cpu", path, ["train.prompts_per_step=1", "train.generations_per_prompt=2",
                                           "train.micro_batch_size=2"])


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def _reward_keys(tmp_path, functions: list[dict], tokenizer) -> list[str]:
    cfg = _config(tmp_path, functions)
    fns = build_reward_fns(cfg.rewards.functions)
    rollout = RolloutBatch(prompt_ids=[[1, 2]], completion_ids=[[22, 24], [22]], finish_reasons=["stop", "stop"])
    scored = score_rollout(cfg, fns, tokenizer, [Prompt("p", [1, 2], {})], rollout)
    _, _, metrics = reward_step(cfg, fns, scored)
    return [k for k in metrics if k.startswith("reward/") and k.count("/") == 2]


def test_file_rewards_are_named_by_function_not_path(tmp_path, tokenizer):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "rew.py").write_text(SOURCE)
    keys = _reward_keys(tmp_path, [
        {"name": f"{tmp_path}/a/rew.py:score"},
        {"name": f"{tmp_path}/b/rew.py:score", "weight": 0.5},
        {"name": "length", "kwargs": {"target": 2}},
        {"name": f"{tmp_path}/a/rew.py:score", "alias": "score-a"},
    ], tokenizer)
    assert keys == ["reward/score_1_of_2/mean", "reward/score_2_of_2/mean", "reward/length/mean",
                    "reward/score-a/mean"]
    for key in keys:
        label = key.split("/")[1]
        assert "\\" not in label and str(tmp_path) not in key and ".py" not in label


def test_duplicate_alias_is_a_config_error(tmp_path):
    with pytest.raises(UserError, match="alias 'x' is given to more than one function"):
        _config(tmp_path, [{"name": "length", "alias": "x"}, {"name": "format", "alias": "x"}])


def test_alias_with_a_path_separator_is_refused(tmp_path):
    with pytest.raises(UserError, match="alias"):
        _config(tmp_path, [{"name": "length", "alias": "a/b"}])
