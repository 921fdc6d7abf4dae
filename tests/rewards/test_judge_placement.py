"""A local judge checkpoint in a run is placed as a local reward model is (test_reward_model_placement): loaded in
the compute dtype, on the device the trainer resolved for `device: auto`, parked in host memory between calls when
a colocated engine needs the room, and counted by `grpo plan`. CUDA is faked: the device is a name the model's
`.to` records, nothing is allocated."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_cli.config.load import build_config
from grpo_cli.rewards.resolve import reward_fns_for, score


@pytest.fixture
def judge_cfg(tiny_checkpoint, tmp_path):
    prompt = tmp_path / "judge.j2"
    prompt.write_text("Rate: {{ completion }}")

    def make(*overrides: str, device: str = "auto"):
        entry = {"judge": tiny_checkpoint, "prompt": str(prompt), "max_tokens": 2, "device": device}
        return build_config(overrides=[f"rewards.functions=[{json.dumps(entry)}]", *overrides])

    return make


def _moves(monkeypatch, model) -> tuple[list, list]:
    moves, emptied = [], []
    monkeypatch.setattr(model, "to", lambda device: moves.append(str(device)) or model)
    monkeypatch.setattr("grpo_cli.runtime.accel.empty_cache", lambda device: emptied.append(str(device)))
    return moves, emptied


def _judge_once(fns) -> None:
    table, _ = score(fns, ["q"], ["one"], {}, on_error="raise")
    assert len(table) == 1


def test_auto_follows_the_trainer_in_the_compute_dtype_parked_beside_a_colocated_engine(judge_cfg, monkeypatch):
    fns = reward_fns_for(judge_cfg("rollout.engine=vllm", "model.dtype=bfloat16"), torch.device("cuda", 1))
    backend = fns[0].fn.backend
    assert str(backend.device) == "cuda:1" and backend.park is True
    weight = next(backend.model.parameters())
    assert weight.device.type == "cpu" and weight.dtype == torch.bfloat16  # in host memory until it judges
    moves, emptied = _moves(monkeypatch, backend.model)
    _judge_once(fns)
    assert moves == ["cuda:1", "cpu"] and emptied == ["cuda:1"]


def test_without_a_colocated_engine_it_stays_on_its_device(judge_cfg, monkeypatch):
    fns = reward_fns_for(judge_cfg("rollout.engine=hf"), torch.device("cpu"))
    backend = fns[0].fn.backend
    assert backend.park is False and next(backend.model.parameters()).dtype == torch.float32
    moves, emptied = _moves(monkeypatch, backend.model)
    _judge_once(fns)
    assert moves == ["cpu"] and emptied == []


def test_grpo_plan_counts_a_local_judge(judge_cfg, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    from grpo_cli.config.plan import host_plan, memory_plan, peak_bytes

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_checkpoint).parameters())
    on_gpu = judge_cfg("model.dtype=bfloat16", "rollout.engine=hf", device="cuda")
    mem = memory_plan(on_gpu, None)
    assert mem["reward_model"] == pytest.approx(params * 2, rel=0.01)  # its parameters in the compute dtype
    without = memory_plan(build_config(overrides=["model.dtype=bfloat16", "rollout.engine=hf"]), None)
    assert peak_bytes(on_gpu, mem) == pytest.approx(peak_bytes(on_gpu, without) + mem["reward_model"])
    on_cpu = judge_cfg(device="cpu")
    assert "reward_model" not in memory_plan(on_cpu, None)
    assert host_plan(on_cpu, memory_plan(on_cpu, None))["reward_model"][0] == pytest.approx(params * 4, rel=0.01)
