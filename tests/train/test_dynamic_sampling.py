"""DAPO dynamic sampling: which groups a step keeps, how many rounds it draws, and what it counts."""

from __future__ import annotations

import torch

from grpo_cli.data.prompts import Prompt
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.scoring.dynamic_sampling import fill_step
from grpo_cli.train.scoring.rewards_phase import ScoredRollout

G = 2
ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0)
NAN = float("nan")


def scored(tag: str, rewards: list[list[float]], version: int = 0) -> ScoredRollout:
    """One group per inner list of G rewards; prompt k is `tag + k`, completion j of it is token 100·k + j."""
    prompts = [Prompt(f"{tag}{k}", [k], {}) for k in range(len(rewards))]
    ids = [[100 * k + j] for k in range(len(rewards)) for j in range(G)]
    batch = RolloutBatch(prompt_ids=[p.ids for p in prompts], completion_ids=ids, finish_reasons=["stop"] * len(ids),
                         sampler_logprobs=[[-0.5 * (j + 1)] for j in range(len(ids))], weight_version=version,
                         timings={"generate": 1.0})
    per_func = torch.tensor([r for group in rewards for r in group]).unsqueeze(1)
    return ScoredRollout(prompts, batch, [str(i[0]) for i in ids], per_func, errors=1)


def run(first, rounds, max_extra_rounds):
    drawn = []

    def draw(r):
        drawn.append(r)
        return rounds[r]

    out = fill_step(first, draw, weights=[1.0], group_size=G, max_extra_rounds=max_extra_rounds, dist=ONE_RANK)
    return (*out, drawn)


def test_keeps_informative_groups_in_order_and_stops_when_full():
    first = scored("a", [[0.0, 0.0], [1.0, 2.0], [NAN, 3.0]], version=0)  # a0 identical, a2 one valid reward
    rounds = {1: scored("b", [[1.0, 1.0], [0.0, 1.0], [2.0, 3.0]], version=1),
              2: scored("c", [[5.0, 6.0], [7.0, 8.0], [7.0, 9.0]], version=1)}
    batch, generated, m, drawn = run(first, rounds, max_extra_rounds=4)
    assert drawn == [1]  # a1 + b1 + b2 fill the 3 groups
    assert [p.text for p in batch.prompts] == ["a1", "b1", "b2"]
    assert batch.rollout.completion_ids == [[100], [101], [100], [101], [200], [201]]
    assert batch.per_func.squeeze(1).tolist() == [1.0, 2.0, 0.0, 1.0, 2.0, 3.0]
    assert batch.rollout.sampler_logprobs == [[-1.5], [-2.0], [-1.5], [-2.0], [-2.5], [-3.0]]
    assert batch.rollout.weight_version == 0  # the stalest round
    assert len(generated.prompts) == 6 and generated.errors == 2 and generated.rollout.timings == {"generate": 2.0}
    assert m == {"dynamic_sampling/dropped_groups": 3.0, "dynamic_sampling/extra_rounds": 1.0,
                 "dynamic_sampling/drawn_prompts": 3.0, "dynamic_sampling/short_groups": 0.0}


def test_round_cap_fills_the_step_with_dropped_groups():
    first = scored("a", [[0.0, 0.0], [1.0, 2.0], [4.0, 4.0]])
    rounds = {1: scored("b", [[1.0, 1.0], [3.0, 3.0], [2.0, 2.0]]), 2: scored("c", [[0.0, 9.0]] * 3)}
    batch, _, m, drawn = run(first, rounds, max_extra_rounds=1)
    assert drawn == [1]
    assert [p.text for p in batch.prompts] == ["a1", "a0", "a2"]  # informative first, then the earliest dropped
    assert m == {"dynamic_sampling/dropped_groups": 3.0, "dynamic_sampling/extra_rounds": 1.0,
                 "dynamic_sampling/drawn_prompts": 3.0, "dynamic_sampling/short_groups": 2.0}


def test_nothing_drawn_when_every_group_is_informative():
    first = scored("a", [[0.0, 1.0], [1.0, 2.0]])
    batch, generated, m, drawn = run(first, {}, max_extra_rounds=3)
    assert drawn == [] and batch.prompts == first.prompts and generated.prompts == first.prompts
    assert m["dynamic_sampling/extra_rounds"] == 0.0 and m["dynamic_sampling/dropped_groups"] == 0.0
