"""Async mode with two training ranks on one real local Ray cluster (two engines in this process, ranks 0 and 1 of
a world of 2, sharing the cluster like two trainer processes do).

The cluster is started the way rank 0 starts it on a GPU machine, with `distributed.device: cuda` and
CUDA_VISIBLE_DEVICES=0,1,5,7: Ray takes any GPU count it is told, so the actors get the ids Ray gives them
(5 and 7) while their torch stays on the CPU. Checks: the cluster holds only the rollout GPUs (item 13), and a
weight sync puts the weights in the object store once, from rank 0, and every actor of both ranks loads them
before its next generation (item 15).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.base import EngineContext

ray = pytest.importorskip("ray")

PROMPTS = [[3, 5, 7], [4, 6]]
SAMPLING = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def ranks(tiny_checkpoint):
    """(rank 0 engine, rank 1 engine, CUDA_VISIBLE_DEVICES of this process after the cluster started)."""
    from grpo_cli.rollout.ray.engine import AsyncRolloutEngine
    from grpo_cli.train.policy import eos_token_ids, load_tokenizer
    from transformers import AutoModelForCausalLM

    if ray.is_initialized():
        ray.shutdown()
    cfg = GRPOConfig.model_validate({
        "model": {"name_or_path": tiny_checkpoint},
        "rollout": {"engine": "hf", "mode": "async", "ray": {"num_actors": 2, "start_timeout_s": 120}},
        "distributed": {"device": "cuda", "num_processes": 2, "rollout_gpus": 2},
    })
    tok = load_tokenizer(tiny_checkpoint)
    ctx = EngineContext(tiny_checkpoint, eos_token_ids(tok, AutoModelForCausalLM.from_pretrained(tiny_checkpoint)),
                        tok.pad_token_id, rank=0, world_size=2)
    said: list = []  # rank 0's broadcasts, replayed to rank 1 in order (what `broadcast_object` does)

    def broadcast(rank):
        return (lambda obj: said.append(obj) or obj) if rank == 0 else (lambda _: said.pop(0))

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "0,1,5,7")
        zero = AsyncRolloutEngine(cfg, ctx, broadcast=broadcast(0))
        one = AsyncRolloutEngine(cfg, dataclasses.replace(ctx, rank=1), broadcast=broadcast(1))
        after = os.environ.get("CUDA_VISIBLE_DEVICES")
    yield zero, one, after
    one.close()
    zero.close()
    ray.shutdown()


def test_local_cluster_holds_only_the_rollout_gpus(ranks):
    zero, one, after = ranks
    assert ray.cluster_resources()["GPU"] == 2
    assert sorted(zero.gpu_ids + one.gpu_ids) == ["5", "7"]  # not 0 and 1, the training processes' GPUs
    assert after == "0,1,5,7"


def _perturbed(tiny_checkpoint: str, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _check_sampled_with(model, batch, tiny_checkpoint):
    """The batch's sampler logprobs are `model`'s logprobs of the sampled tokens."""
    from grpo_cli.rollout.hf.engine import HFEngine

    local = HFEngine(model, eos_token_ids=[], pad_token_id=0, shares_policy_weights=False)
    seqs = [batch.prompt_ids[j // SAMPLING.n] + batch.completion_ids[j] for j in range(len(batch.completion_ids))]
    for row, scored in zip(batch.sampler_logprobs, local.score(seqs), strict=True):
        if row:
            torch.testing.assert_close(torch.tensor(row), torch.tensor(scored[-len(row):]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("follower_streams", [False, True])
def test_sync_puts_once_and_every_rank_loads_it(ranks, tiny_checkpoint, monkeypatch, follower_streams):
    """Rank 0's `update_weights` puts one buffer per bucket (no put from rank 1, whose `follow_update` takes the same
    refs from the weight board); batches queued before the sync keep the old version on both ranks, batches after
    it carry the new version and are sampled with the new weights; the board lets go of the buffers once rank 1
    took them. `follower_streams`: a caller that streams to every rank (rank 1 drains its stream and follows)."""
    from grpo_cli.rollout.flat_weights import byte_buckets

    zero, one, _ = ranks
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value.nbytes) or real_put(value, **kw))
    model = _perturbed(tiny_checkpoint, seed=int(follower_streams))
    named = list(model.state_dict().items())
    for engine in (zero, one):
        engine.bucket_bytes = 64 * 1024  # several buffers per push
    version = zero.weight_version + 1
    for engine in (zero, one):
        engine.submit("before", PROMPTS, SAMPLING)
    zero.update_weights(iter(named), version)
    if follower_streams:
        one.update_weights(iter(named), version)
    else:
        one.follow_update(version)
    for engine in (zero, one):
        engine.submit("after", PROMPTS, SAMPLING)
    buckets = list(byte_buckets(iter(named), 64 * 1024))
    assert len(puts) == len(buckets) > 2  # one copy of the weights in the object store for the job, not one per rank
    assert sum(puts) >= sum(t.numel() * t.element_size() for _, t in named)
    for engine in (zero, one):
        before, after = engine.collect("before"), engine.collect("after")
        assert (before.weight_version, after.weight_version, engine.weight_version) == (version - 1, version, version)
        _check_sampled_with(model, after, tiny_checkpoint)
        held = engine.read_weights(["model.norm.weight"])["model.norm.weight"]
        torch.testing.assert_close(held, model.state_dict()["model.norm.weight"])
    assert ray.get(zero.board.held.remote()) == 0  # superseded: only the queued loads held the buffers


def test_board_take_waits_for_the_post_and_keeps_the_buffers_alive(ranks):
    """A rank that asks before rank 0 posted waits (the board is an async actor: the post still gets in); the refs
    posted nested in the arguments keep their buffers alive after the poster dropped its own, and the board lets go
    of them once every follower took them."""
    from grpo_cli.rollout.ray.actor import WeightBoard

    board = ray.remote(num_cpus=0)(WeightBoard).remote(2)
    early = [board.take.remote(1), board.take.remote(1)]
    ready, _ = ray.wait(early, timeout=0.5)
    assert ready == []
    ref = ray.put(torch.arange(6, dtype=torch.uint8).numpy())
    ray.get(board.post.remote(1, 7, [("layout", ref)]))
    del ref
    (v1, parts1), (v2, parts2) = ray.get(early, timeout=30)
    assert v1 == v2 == 7 and parts1[0][0] == "layout"
    assert ray.get(parts1[0][1]).tolist() == list(range(6))
    assert ray.get(board.held.remote()) == 0
    ray.kill(board)
