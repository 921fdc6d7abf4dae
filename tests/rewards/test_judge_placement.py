"""A local judge checkpoint in a run is placed as a local reward model is (test_reward_model_placement): loaded in
the compute dtype, on the device the trainer resolved for `device: auto`, parked in host memory between calls when
a colocated engine needs the room (moved there once per scoring call, from pinned host memory), and counted by
`grpo plan`. CUDA is faked (`fake_cuda`): the device is a name, nothing is allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fake_cuda import FakeCuda, tensor_count

from grpo_cli.config.load import build_config
from grpo_cli.rewards import model as rm_module
from grpo_cli.rewards.resolve import reward_fns_for, score


@pytest.fixture
def judge_cfg(tiny_checkpoint, tmp_path):
    prompt = tmp_path / "judge.j2"
    prompt.write_text("Rate: {{ completion }}")

    def make(*overrides: str, device: str = "auto", **settings):
        entry = {"judge": tiny_checkpoint, "prompt": str(prompt), "max_tokens": 2, "device": device, **settings}
        return build_config(overrides=[f"rewards.functions=[{json.dumps(entry)}]", *overrides])

    return make


def _moves(monkeypatch, model) -> tuple[list, list]:
    moves, emptied = [], []
    monkeypatch.setattr(model, "to", lambda device: moves.append(str(device)) or model)
    monkeypatch.setattr("grpo_cli.runtime.accel.empty_cache", lambda device: emptied.append(str(device)))
    return moves, emptied


def _judge_once(fns, n: int = 1) -> None:
    table, _ = score(fns, ["q"] * n, [f"answer {i}" for i in range(n)], {}, on_error="raise")
    assert len(table) == n


def test_auto_follows_the_trainer_in_the_compute_dtype_parked_beside_a_colocated_engine(judge_cfg, monkeypatch):
    fns = reward_fns_for(judge_cfg("rollout.engine=vllm", "model.dtype=bfloat16"), torch.device("cuda", 1))
    backend = fns[0].fn.backend
    assert str(backend.device) == "cuda:1" and backend.park is True
    weight = next(backend.model.parameters())
    assert weight.device.type == "cpu" and weight.dtype == torch.bfloat16  # in host memory until it judges
    cuda = FakeCuda(monkeypatch)
    _judge_once(fns)
    assert cuda.moves(tensor_count(backend.model)) == ["cuda:1", "cpu"] and cuda.emptied == ["cuda:1"]


def test_a_parked_judge_moves_once_per_scoring_call_from_pinned_memory(judge_cfg, monkeypatch):
    """Issue 46 (4.4): 5 completions at batch_size 2 are 3 batches, but one move to the device and one back per
    scoring call (it was one round trip per batch: 64 of a 7B judge for 512 completions), every host copy pinned
    once for the run, each copy there non-blocking; a call whose answers are all cached moves nothing."""
    parser = f"{Path(__file__).with_name('judge_parsers.py')}:any_answer"
    fns = reward_fns_for(judge_cfg("rollout.engine=vllm", batch_size=2, parse=parser), torch.device("cuda", 1))
    model = fns[0].fn.backend.model
    cuda = FakeCuda(monkeypatch)
    _judge_once(fns, 5)
    assert cuda.entered == 1 and cuda.moves(tensor_count(model)) == ["cuda:1", "cpu"]
    assert cuda.pinned == tensor_count(model) and all(blocking for _, blocking in cuda.copies)
    _judge_once(fns, 5)  # the same judge prompts within the step: answered from the cache
    assert cuda.entered == 1
    fns[0].fn.pop_metrics()  # the next step asks again: moved again, pinned no more
    _judge_once(fns, 3)
    assert cuda.moves(tensor_count(model)) == ["cuda:1", "cpu"] * 2 and cuda.pinned == tensor_count(model)
    assert cuda.emptied == ["cuda:1"] * 2
    parked = rm_module._HOMES[model]  # each parameter waits in its pinned host copy, not in a copy of that
    assert all(home.is_pinned() and tensor.data_ptr() == home.data_ptr() for tensor, home in parked)


def test_without_a_colocated_engine_it_stays_on_its_device(judge_cfg, monkeypatch):
    fns = reward_fns_for(judge_cfg("rollout.engine=hf"), torch.device("cpu"))
    backend = fns[0].fn.backend
    assert backend.park is False and next(backend.model.parameters()).dtype == torch.float32
    moves, emptied = _moves(monkeypatch, backend.model)
    _judge_once(fns)
    assert moves == ["cpu"] and emptied == []


def test_grpo_plan_counts_a_local_judge(judge_cfg, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    from grpo_cli.planner.plan import host_plan, memory_plan, peak_bytes

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_checkpoint).parameters())
    on_gpu = judge_cfg("model.dtype=bfloat16", "rollout.engine=hf", device="cuda")
    mem = memory_plan(on_gpu, None)
    assert mem["reward_model"] == pytest.approx(params * 2, rel=0.01)  # its parameters in the compute dtype
    without = memory_plan(build_config(overrides=["model.dtype=bfloat16", "rollout.engine=hf"]), None)
    assert peak_bytes(on_gpu, mem) == pytest.approx(peak_bytes(on_gpu, without) + mem["reward_model"])
    on_cpu = judge_cfg(device="cpu")
    assert "reward_model" not in memory_plan(on_cpu, None)
    assert host_plan(on_cpu, memory_plan(on_cpu, None))["reward_model"][0] == pytest.approx(params * 4, rel=0.01)
