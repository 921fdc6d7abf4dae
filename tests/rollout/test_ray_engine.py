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
from grpo_cli.rollout.base import EngineContext
from grpo_cli.rollout.ray.batches import merge_batches, split_evenly

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
    from grpo_cli.rollout.ray.engine import AsyncRolloutEngine

    engine = AsyncRolloutEngine(_cfg(tiny_checkpoint, 2), _ctx(tiny_checkpoint))
    yield engine
    engine.close()
    ray.shutdown()


def _local_engine(tiny_checkpoint: str):
    from grpo_cli.rollout.hf.engine import HFEngine
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


def test_merge_keeps_multi_turn_fields_and_weighs_tool_metrics():
    """Masks, trajectories and environment rewards are concatenated in actor order; tool counts add up and
    per-rollout means are weighted by each actor's rollouts (3 + 1 here)."""
    a = RolloutBatch([[1]] * 3, [[2, 3]] * 3, ["stop"] * 3, loss_masks=[[1, 0]] * 3, trajectories=[[{"a": 1}]] * 3,
                     environment_rewards=[1.0, None, 2.0], metrics={"tools/turns": 2.0, "tools/errors": 1.0},
                     timings={"generate": 1.0, "tools": 0.5})
    b = RolloutBatch([[4]], [[5]], ["length"], loss_masks=[[1]], trajectories=[[{"b": 2}]], environment_rewards=[3.0],
                     metrics={"tools/turns": 4.0, "tools/errors": 2.0}, timings={"generate": 2.0})
    m = merge_batches([a, b])
    assert m.loss_masks == [[1, 0]] * 3 + [[1]] and m.trajectories == [[{"a": 1}]] * 3 + [[{"b": 2}]]
    assert m.environment_rewards == [1.0, None, 2.0, 3.0] and m.finish_reasons == ["stop"] * 3 + ["length"]
    assert m.metrics == {"tools/turns": (3 * 2.0 + 4.0) / 4, "tools/errors": 3.0}
    assert m.timings == {"generate": 2.0, "tools": 0.5}
    assert merge_batches([dataclasses.replace(a, loss_masks=None), b]).loss_masks is None


def test_actors_are_placed_on_the_placement_group(manager):
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(manager.pg)
    assert table["state"] == "CREATED"
    assert len(table["bundles"]) == 2 and all(b["CPU"] == 1 for b in table["bundles"].values())
    assert len(set(manager.pids)) == 2


def test_actor_samples_what_the_local_engine_samples(manager, tiny_checkpoint):
    """Actor i samples its consecutive chunk of prompts as an engine of rank i does (its seeds keyed by its number,
    rollout/seeds.py): the merged batch equals local generation chunk by chunk at ranks 0 and 1 (same weights,
    same step seed), prompt order kept."""
    model, local = _local_engine(tiny_checkpoint)
    manager.update_weights(iter(model.state_dict().items()), manager.weight_version + 1)
    got = manager.generate(PROMPTS, SAMPLING)
    chunks = split_evenly(PROMPTS, 2)
    want = []
    for i, c in enumerate(chunks):
        local.rank = i
        want.append(local.generate(c, SAMPLING))
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


# ---- item 13: the local cluster sees only the rollout GPUs ---------------------------------------------------

def test_trainer_gpu_ids_follow_cuda_visible_devices():
    from grpo_cli.rollout.ray.engine import trainer_gpu_ids

    assert trainer_gpu_ids({"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"}) == ["GPU-a1", "GPU-b2"]
    assert trainer_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}, device_count=8) == []
    assert trainer_gpu_ids({}, device_count=3) == ["0", "1", "2"]


def test_rollout_gpu_ids_are_the_ones_after_the_training_gpus():
    from grpo_cli.rollout.ray.engine import rollout_gpu_ids

    assert rollout_gpu_ids([str(i) for i in range(8)], num_processes=4, rollout_gpus=4) == ["4", "5", "6", "7"]
    assert rollout_gpu_ids(["3", "2", "1", "0"], num_processes=2, rollout_gpus=1) == ["1"]
    with pytest.raises(RolloutError, match=r"2 GPU\(s\) .* 3 more .* = 5, but this machine shows 4"):
        rollout_gpu_ids(["0", "1", "2", "3"], num_processes=2, rollout_gpus=3)
    with pytest.raises(RolloutError, match=r"distributed\.rollout_gpus is 0"):
        rollout_gpu_ids(["0", "1"], num_processes=1, rollout_gpus=0)


class _FakeRay:
    """Records what `ray.init` is given and the CUDA_VISIBLE_DEVICES the processes it starts would inherit."""

    def __init__(self):
        self.calls = []

    def is_initialized(self):
        return False

    def init(self, **kwargs):
        import os

        self.calls.append((kwargs, os.environ.get("CUDA_VISIBLE_DEVICES")))


def _start_local(monkeypatch, cfg, ctx):
    from grpo_cli.rollout.ray import engine as ray_engine

    fake = _FakeRay()
    monkeypatch.setattr(ray_engine, "import_ray", lambda: fake)
    ray_engine.connect(cfg, ctx)
    (call,) = fake.calls
    return call


def _gpu_cfg(tiny_checkpoint: str, **distributed) -> GRPOConfig:
    return GRPOConfig.model_validate({
        "model": {"name_or_path": tiny_checkpoint},
        "rollout": {"engine": "hf", "mode": "async", "ray": {"num_actors": 2}},
        "distributed": {"device": "cuda", "num_processes": 2, "rollout_gpus": 2, **distributed},
    })


def test_rank0_starts_ray_with_only_the_rollout_gpus(monkeypatch, tiny_checkpoint):
    """CUDA_VISIBLE_DEVICES=0,1,5,7 with 2 training processes: Ray gets 2 GPUs and its raylet sees 5,7 (Ray maps
    a worker's GPU slot i to entry i of what it inherited); the trainer's own variable is back afterwards."""
    ctx = EngineContext(tiny_checkpoint, [0], 0, rank=0, world_size=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,5,7")
    kwargs, seen = _start_local(monkeypatch, _gpu_cfg(tiny_checkpoint), ctx)
    assert kwargs["num_gpus"] == 2 and seen == "5,7"
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,5,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # unset: the ids come from the device count (mocked: no GPU here)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    kwargs, seen = _start_local(monkeypatch, _gpu_cfg(tiny_checkpoint), ctx)
    assert kwargs["num_gpus"] == 2 and seen == "2,3" and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_cpu_trainer_starts_ray_without_gpus(monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cfg = _gpu_cfg(tiny_checkpoint, device="cpu", rollout_gpus=0, num_processes=1)
    kwargs, seen = _start_local(monkeypatch, cfg, EngineContext(tiny_checkpoint, [0], 0))
    assert kwargs["num_gpus"] == 0 and seen == ""


# ---- item 14: no tensor parallelism inside an actor; item 16: an actor's share of the step --------------------

def test_async_refuses_tensor_parallel_actors_and_a_local_cluster_over_machines():
    from grpo_cli.config.load import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"rollout\.vllm\.tensor_parallel_size=2 is not available in async mode.*"
                                          r"rollout\.vllm\.tensor_parallel_size=1"):
        build_config("qwen-7b-async", overrides=["rollout.vllm.tensor_parallel_size=2",
                                                 "distributed.rollout_gpus=8"])
    with pytest.raises(ConfigError, match=r"rollout\.ray\.address is null.*num_machines=2.*rollout\.ray\.address=auto"):
        build_config("qwen-7b-async", overrides=["distributed.num_machines=2", "distributed.main_process_ip=10.0.0.1",
                                                 "rollout.ray.num_actors=8"])
    cfg = build_config("qwen-7b-async", overrides=["distributed.num_machines=2", "distributed.main_process_ip=10.0.0.1",
                                                   "rollout.ray.num_actors=8", "rollout.ray.address=auto"])
    assert cfg.rollout.ray.address == "auto"


def test_sequences_per_actor_is_the_actor_share():
    from grpo_cli.config.load import build_config
    from grpo_cli.rollout.ray.actor import sequences_per_actor

    assert sequences_per_actor(build_config("qwen-7b-async")) == 64 // 4 * 8
    two = build_config("qwen-7b-async", overrides=["distributed.num_processes=2", "rollout.ray.num_actors=4",
                                                   "train.prompts_per_step=66", "train.micro_batch_size=1"])
    assert sequences_per_actor(two) == 17 * 8  # 33 prompts per rank over 2 actors: 17 and 16


def test_actor_vllm_engine_defaults_to_its_share(monkeypatch, tiny_checkpoint):
    """vLLM's own default sizes for a rank's whole share (an actor's context has world size 1): the actor passes
    its share of the step instead."""
    from grpo_cli.rollout.vllm import engine as vllm_engine
    from grpo_cli.rollout.ray.actor import build_actor_engine

    seen = {}
    monkeypatch.setattr(vllm_engine.VLLMEngine, "from_config",
                        classmethod(lambda cls, cfg, ctx: seen.setdefault("cfg", cfg)))
    cfg = GRPOConfig.model_validate({"model": {"name_or_path": tiny_checkpoint},
                                     "rollout": {"engine": "vllm", "mode": "async", "ray": {"num_actors": 4}},
                                     "train": {"prompts_per_step": 8, "generations_per_prompt": 4}})
    build_actor_engine(cfg.model_dump(mode="json"), dataclasses.asdict(EngineContext(tiny_checkpoint, [0], 0)))
    assert seen["cfg"].rollout.vllm.max_num_seqs == 2 * 4


@pytest.mark.parametrize(("device", "available", "expected"), [
    ("auto", True, "cuda"), ("cuda", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu")])
def test_actor_hf_engine_device(monkeypatch, tiny_checkpoint, device, available, expected):
    """An actor's hf engine loads its model copy on CUDA when the run may use it and a GPU is there (CUDA mocked:
    the branch a GPU run takes), else on the CPU."""
    import torch

    from grpo_cli.rollout.hf import generation_copy as hf_copy
    from grpo_cli.rollout.ray.actor import build_actor_engine

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(hf_copy, "hf_copy_engine", lambda cfg, ctx, device: seen.setdefault("device", device))
    cfg = GRPOConfig.model_validate({"model": {"name_or_path": tiny_checkpoint},
                                     "rollout": {"mode": "async"},
                                     "distributed": {"device": device, "rollout_gpus": int(device == "cuda")}})
    build_actor_engine(cfg.model_dump(mode="json"), dataclasses.asdict(EngineContext(tiny_checkpoint, [0], 0)))
    assert seen["device"] == expected


@pytest.mark.parametrize("name", ["qwen-7b-async", "tiny-cpu-async"])
def test_async_presets_size_vllm_per_actor(name):
    """A preset's per-actor max_num_seqs covers the actor's share, and (for a named model on dedicated rollout GPUs)
    the KV cache of that share at full length fits in what gpu_memory_utilization leaves after the weights on an
    80 GiB GPU (qwen-7b-async had 0.3: ~8 GiB for 17.5 GiB of KV, so vLLM preempted)."""
    from grpo_cli.config.load import build_config
    from grpo_cli.config.model_shape import BYTES, model_shape
    from grpo_cli.rollout.ray.actor import sequences_per_actor

    cfg = build_config(name)
    v, share = cfg.rollout.vllm, sequences_per_actor(cfg)
    assert v.max_num_seqs is None or v.max_num_seqs >= share, (v.max_num_seqs, share)
    if cfg.distributed.device != "cuda":
        return
    shape, wbytes = model_shape(cfg.model.name_or_path), BYTES[cfg.model.dtype]
    tokens = share * (cfg.data.max_prompt_length + cfg.rollout.max_completion_length)
    kv = tokens * 2 * shape.layers * shape.kv_dim * wbytes
    budget = v.gpu_memory_utilization * 80 * 2**30 - shape.params * wbytes - 2 * 2**30
    assert kv <= budget, (kv / 2**30, budget / 2**30)
