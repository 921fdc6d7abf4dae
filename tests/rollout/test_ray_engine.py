"""Async mode's rollout manager on a real local Ray cluster: hf engine actors placed on a placement group.

Checks the properties the one-step-ahead pipeline relies on: a batch is stamped with the version of the weights
that sampled it, a weight push queued behind a generation lands after it and before the next one, actors sample
exactly what the in-process engine samples with the same weights and seed, and several actors keep prompt order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.rollout.base import RolloutBatch, RolloutError, SamplingParams
from grpo_cli.rollout.factory import EngineContext
from grpo_cli.rollout.ray_engine import merge_batches, split_evenly

ray = pytest.importorskip("ray")

PROMPTS = [[3, 5, 7], [4, 6], [8, 9, 10, 11]]
SAMPLING = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11)


def _cfg(tiny_checkpoint: str, actors: int) -> GRPOConfig:
    return GRPOConfig.model_validate({
        "model": {"name_or_path": tiny_checkpoint},
        "rollout": {"engine": "hf", "mode": "async", "ray": {"num_actors": actors, "start_timeout_s": 120}},
    })


def _ctx(tiny_checkpoint: str) -> EngineContext:
    from grpo_cli.train.policy import eos_token_ids, load_tokenizer
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    return EngineContext(tiny_checkpoint, eos_token_ids(tok, model), tok.pad_token_id)


@pytest.fixture(scope="module")
def manager(tiny_checkpoint):
    """Two hf actors (1 CPU each) on a local Ray cluster started by the manager itself."""
    from grpo_cli.rollout.ray_engine import AsyncRolloutEngine

    engine = AsyncRolloutEngine(_cfg(tiny_checkpoint, 2), _ctx(tiny_checkpoint))
    yield engine
    engine.close()
    ray.shutdown()


def _local_engine(tiny_checkpoint: str):
    from grpo_cli.rollout.hf import HFEngine
    from transformers import AutoModelForCausalLM

    ctx = _ctx(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval().requires_grad_(False)
    return model, HFEngine(model, eos_token_ids=ctx.eos_token_ids, pad_token_id=ctx.pad_token_id,
                           shares_policy_weights=False)


def test_split_evenly_keeps_order_and_sizes():
    assert split_evenly([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split_evenly([1], 3) == [[1], [], []]
    assert sum(split_evenly(list(range(10)), 4), []) == list(range(10))


def test_merge_refuses_mixed_weight_versions():
    part = RolloutBatch([[1]], [[2]], ["stop"], [[-0.1]], weight_version=0)
    with pytest.raises(RolloutError, match="different weight versions"):
        merge_batches([part, dataclasses.replace(part, weight_version=1)])


def test_actors_are_placed_on_the_placement_group(manager):
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(manager.pg)
    assert table["state"] == "CREATED"
    assert len(table["bundles"]) == 2 and all(b["CPU"] == 1 for b in table["bundles"].values())
    assert len(set(manager.pids)) == 2


def test_actor_samples_what_the_local_engine_samples(manager, tiny_checkpoint):
    """Actor i uses seed + i·stride on its consecutive chunk of prompts: the merged batch equals local
    generation chunk by chunk (same weights, same seeds), prompt order kept."""
    from grpo_cli.rollout.ray_engine import ACTOR_SEED_STRIDE

    model, local = _local_engine(tiny_checkpoint)
    manager.update_weights(iter(model.state_dict().items()), manager.weight_version + 1)
    got = manager.generate(PROMPTS, SAMPLING)
    chunks = split_evenly(PROMPTS, 2)
    want = [local.generate(c, dataclasses.replace(SAMPLING, seed=SAMPLING.seed + i * ACTOR_SEED_STRIDE))
            for i, c in enumerate(chunks)]
    assert got.prompt_ids == PROMPTS
    assert got.completion_ids == [row for w in want for row in w.completion_ids]
    flat_got = torch.tensor([x for row in got.sampler_logprobs for x in row])
    flat_want = torch.tensor([x for w in want for row in w.sampler_logprobs for x in row])
    torch.testing.assert_close(flat_got, flat_want, atol=1e-5, rtol=0)


def test_push_queued_behind_generation_lands_between_batches(manager, tiny_checkpoint):
    """submit A; push v+1 (new weights); submit B: A is sampled with the old version, B with the new one, and
    B's sampler logprobs are the new weights' logprobs of B's tokens."""
    model, local = _local_engine(tiny_checkpoint)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    version = manager.weight_version + 1
    manager.bucket_bytes = 64 * 1024  # several buckets: the push spans many object-store buffers
    manager.submit("a", PROMPTS, SAMPLING)
    manager.update_weights(iter(model.state_dict().items()), version)
    manager.submit("b", PROMPTS, SAMPLING)
    a, b = manager.collect("a"), manager.collect("b")
    assert (a.weight_version, b.weight_version) == (version - 1, version)
    seqs = [b.prompt_ids[j // SAMPLING.n] + b.completion_ids[j] for j in range(len(b.completion_ids))]
    scored = local.score(seqs)
    for j, row in enumerate(b.sampler_logprobs):
        want = scored[j][-len(row):] if row else []
        torch.testing.assert_close(torch.tensor(row), torch.tensor(want), atol=1e-4, rtol=0)
    held = manager.read_weights(["model.norm.weight"])
    torch.testing.assert_close(held["model.norm.weight"], model.state_dict()["model.norm.weight"])


def test_flat_weights_round_trip_any_dtype():
    from grpo_cli.rollout.flat_weights import flatten, unflatten

    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.arange(6).reshape(2, 3)),
             ("d", torch.randn(2, 3).t())]  # non-contiguous
    layout, buffer = flatten(named)
    back = dict(unflatten(layout, buffer))
    assert list(back) == ["a", "b", "c", "d"]
    for name, tensor in named:
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)


def test_byte_buckets_cap_and_order():
    from grpo_cli.rollout.flat_weights import byte_buckets

    named = [(str(i), torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]  # fp32: 40, 40, 120, 20, 20 bytes
    groups = [[name for name, _ in b] for b in byte_buckets(iter(named), 80)]
    assert groups == [["0", "1"], ["2"], ["3", "4"]]
