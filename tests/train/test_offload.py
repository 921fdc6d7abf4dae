"""Training-state offload: round trips through fresh host storage (forced on CPU), no-op when idle, DeepSpeed
engines driven through their own offload_states/reload_states."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

from grpo_cli.config.sections import OffloadConfig
from grpo_cli.train.weights.offload import TrainingStateOffload


def trained_pair():
    """A model + AdamW after one step with gradients left in place, and an untouched deep copy of both."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    model(torch.randn(5, 4)).pow(2).sum().backward()
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return model, opt, twin, twin_opt


def state_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]


def test_round_trip_moves_storage_and_restores_values():
    model, opt, twin, twin_opt = trained_pair()
    off = TrainingStateOffload(model, opt, optimizer_state=True, grads=True, params=True, force=True)
    params_before = [p.data_ptr() for p in model.parameters()]
    state_before = [t.data_ptr() for t in state_tensors(opt)]
    identities = [id(p) for p in model.parameters()]

    assert off.offload() >= 0.0 and off.offloaded
    assert all(p.grad is None for p in model.parameters())  # parked outside the module
    assert all(p.data_ptr() != b for p, b in zip(model.parameters(), params_before))
    assert all(t.data_ptr() != b for t, b in zip(state_tensors(opt), state_before))
    assert off.offload() == 0.0  # already offloaded

    assert off.reload() >= 0.0 and not off.offloaded
    assert [id(p) for p in model.parameters()] == identities  # the optimizer still points at them
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    for a, b in zip(state_tensors(opt), state_tensors(twin_opt), strict=True):
        assert torch.equal(a, b)
    opt.step()
    twin_opt.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert off.reload() == 0.0


def test_only_the_selected_state_moves():
    model, opt, *_ = trained_pair()
    off = TrainingStateOffload(model, opt, optimizer_state=True, grads=False, params=False, force=True)
    params_before = [p.data_ptr() for p in model.parameters()]
    off.offload()
    assert [p.data_ptr() for p in model.parameters()] == params_before
    assert all(p.grad is not None for p in model.parameters())
    off.reload()


def test_cpu_training_is_a_noop_reporting_zero():
    model, opt, *_ = trained_pair()
    off = TrainingStateOffload(model, opt, optimizer_state=True, grads=True, params=True)
    before = [p.data_ptr() for p in model.parameters()]
    assert not off.active
    assert off.offload() == 0.0 and off.reload() == 0.0
    assert [p.data_ptr() for p in model.parameters()] == before
    with off.offloaded_state() as seconds:
        pass
    assert seconds == {"offload": 0.0, "reload": 0.0}


def test_from_config_none_without_flags():
    model, opt, *_ = trained_pair()
    assert TrainingStateOffload.from_config(OffloadConfig(), model, opt) is None
    off = TrainingStateOffload.from_config(OffloadConfig(optimizer=True), model, opt)
    assert off is not None and off.flags == {"optimizer": True, "grads": False, "params": False}


class FakeDeepSpeedEngine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.calls: list = []

    def offload_states(self, include, device, pin_memory, non_blocking):
        self.calls.append(("offload", sorted(include), device))

    def reload_states(self, non_blocking):
        self.calls.append(("reload",))


@pytest.fixture
def ds_offload_enums(monkeypatch):
    """DeepSpeed's offload enums as plain strings (the real module needs DeepSpeed's accelerator set up)."""
    enums = types.ModuleType("deepspeed.runtime.zero.offload_config")
    enums.OffloadStateTypeEnum = types.SimpleNamespace(
        optim_states="optim_states", hp_params="hp_params", lp_params="lp_params", lp_grads="lp_grads",
        contiguous_grad_buffer="contiguous_grad_buffer")
    enums.OffloadDeviceEnum = types.SimpleNamespace(cpu="cpu")
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.offload_config", enums)


def test_deepspeed_engine_uses_its_own_offload(ds_offload_enums):
    engine = FakeDeepSpeedEngine()
    off = TrainingStateOffload(engine, None, optimizer_state=False, grads=True, params=True, force=True)
    off.offload()
    off.reload()
    assert engine.calls == [("offload", ["contiguous_grad_buffer", "lp_grads", "lp_params"], "cpu"), ("reload",)]


@pytest.mark.parametrize("cpu_optimizer", [True, False])
def test_zero3_cpu_optimizer_keeps_its_gradient_partitions(ds_offload_enums, cpu_optimizer):
    """Under ZeRO-3 + offload_optimizer the gradient partitions are on the host already; offloading them made a
    second pinned copy and `reload_states` then put them on the GPU (DeepSpeed 0.19.8). Only the bucket moves."""
    engine = FakeDeepSpeedEngine()
    zero3 = types.SimpleNamespace(offload_optimizer=cpu_optimizer, state={})
    TrainingStateOffload(engine, zero3, optimizer_state=False, grads=True, params=False, force=True).offload()
    moved = ["contiguous_grad_buffer"] if cpu_optimizer else ["contiguous_grad_buffer", "lp_grads"]
    assert engine.calls == [("offload", moved, "cpu")]
