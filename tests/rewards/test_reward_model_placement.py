"""A local reward model (`{model: PATH}`) in a run (issue 36): loaded in the compute dtype, on the device the trainer
resolved (not a fresh `auto`), parked in pinned host memory between scorings when a colocated engine needs the room
(one move there per scoring call), sized by `grpo plan`, and refused under process isolation off the CPU. CUDA is
faked (`fake_cuda`, or the model's `.to` recorded where it stays put): the device is a name, nothing is allocated."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCuda, tensor_count
from typer.testing import CliRunner

from grpo_cli.config.load import build_config
from grpo_cli.rewards import model as rm_module
from grpo_cli.rewards.resolve import reward_fns_for, score


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo_cli.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("rm")
    tok = build_tokenizer(path, chars=True)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    return str(path)


def _cfg(rm_path: str, *overrides: str, device: str = "auto", extra: str = ""):
    return build_config(overrides=[f"rewards.functions=[{{model: {rm_path}, device: {device}{extra}}}]", *overrides])


class Moves:
    """Records the reward model's `.to` targets (without moving: the fake CUDA device exists in name only) and the
    device caches emptied."""

    def __init__(self, monkeypatch, net):
        self.to, self.emptied = [], []
        monkeypatch.setattr(net, "to", lambda device: self.to.append(str(device)) or net)
        monkeypatch.setattr("grpo_cli.runtime.accel.empty_cache", lambda device: self.emptied.append(str(device)))


def _score(fns) -> list[float]:
    table, _ = score(fns, ["q "] * 2, ["one", "one two"], {}, on_error="raise")
    return [row[0] for row in table]


def test_the_reward_model_loads_in_the_compute_dtype(rm_path, monkeypatch):
    loaded = []
    real = rm_module._load

    def spy(*args):
        net, tok = real(*args)
        loaded.append(next(net.parameters()).dtype)
        return net, tok

    monkeypatch.setattr(rm_module, "_load", spy)
    values = _score(reward_fns_for(_cfg(rm_path, "model.dtype=bfloat16"), torch.device("cpu")))
    assert loaded and set(loaded) == {torch.bfloat16} and all(v == v for v in values)


def test_auto_follows_the_trainers_device_and_a_colocated_engine_gets_it_parked(rm_path, monkeypatch):
    """`device: auto` is the device the trainer resolved (cuda:1 here, with no CUDA to find by a fresh `auto`); with
    colocated vLLM the model goes to that device once per scoring call (3 batches here) from pinned host memory,
    pinned once, and back after, its blocks handed back."""
    fns = reward_fns_for(_cfg(rm_path, "rollout.engine=vllm", extra=", batch_size: 1"),
                         torch.device("cuda", 1))
    assert fns[0].kwargs["device"] == "cuda:1" and fns[0].kwargs["park"] is True
    net = rm_module._load(rm_path, "float32")[0]
    cuda = FakeCuda(monkeypatch)
    _score(fns)
    _score(fns)
    assert cuda.moves(tensor_count(net)) == ["cuda:1", "cpu"] * 2 and cuda.emptied == ["cuda:1"] * 2
    assert cuda.pinned == tensor_count(net) and all(non_blocking for _, non_blocking in cuda.copies)


def test_without_a_colocated_engine_to_make_room_for_it_stays_put(rm_path, monkeypatch):
    fns = reward_fns_for(_cfg(rm_path, "rollout.engine=hf"), torch.device("cuda", 0))
    moves = Moves(monkeypatch, rm_module._load(rm_path, "float32")[0])
    _score(fns)
    assert fns[0].kwargs["park"] is False and moves.to == ["cuda:0"] and moves.emptied == []


def test_on_cpu_the_move_is_made_and_changes_nothing(rm_path, monkeypatch):
    fns = reward_fns_for(_cfg(rm_path, "rollout.engine=vllm", "distributed.device=cpu"), torch.device("cpu"))
    before = _score(fns)
    net = rm_module._load(rm_path, "float32")[0]
    storage = [t.data_ptr() for t in net.parameters()]
    emptied = []
    monkeypatch.setattr("grpo_cli.runtime.accel.empty_cache", lambda device: emptied.append(str(device)))
    assert _score(fns) == before and emptied == ["cpu"]
    assert [t.data_ptr() for t in net.parameters()] == storage  # nothing copied, nothing pinned


def test_grpo_plan_counts_the_reward_model(rm_path):
    from transformers import AutoModelForSequenceClassification

    from grpo_cli.planner.plan import host_plan, memory_plan, peak_bytes
    from grpo_cli.planner.plan_render import render_plan

    params = sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(rm_path).parameters())
    gpu = _cfg(rm_path, "model.dtype=bfloat16", "rollout.engine=hf")
    mem = memory_plan(gpu, None)
    assert mem["reward_model"] == params * 2  # its parameters in the compute dtype
    assert "reward_model" in render_plan(gpu, gpu_mem=None)
    without = memory_plan(build_config(overrides=["model.dtype=bfloat16", "rollout.engine=hf"]), None)
    assert peak_bytes(gpu, mem) == pytest.approx(peak_bytes(gpu, without) + params * 2)
    parked = _cfg(rm_path, "model.dtype=bfloat16", "rollout.engine=vllm")
    assert host_plan(parked, memory_plan(parked, None))["reward_model_parked"][0] == params * 2
    on_cpu = _cfg(rm_path, device="cpu")
    assert "reward_model" not in memory_plan(on_cpu, None)
    assert host_plan(on_cpu, memory_plan(on_cpu, None))["reward_model"][0] == params * 4


def test_process_isolation_off_the_cpu_is_refused(rm_path):
    from grpo_cli.cli.main import app

    spec = f"rewards.functions=[{{model: {rm_path}, device: cuda, isolation: process}}]"
    result = CliRunner().invoke(app, ["train", "--set", spec, "--dry-run"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "isolation: process" in text and "device: cpu" in text and "isolation: inline" in text
    build_config(overrides=[f"rewards.functions=[{{model: {rm_path}, device: cpu, isolation: process}}]"])
