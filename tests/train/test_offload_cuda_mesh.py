"""`distributed.offload` of FSDP2 state whose mesh is a GPU mesh: the host copy of a DTensor's shard stays on the host
(`DTensor.from_local` moved it back to the mesh's `cuda` device, so nothing left the GPU), and the meter counts a
place as moved only when its new storage is in host memory. Driven on CPU: a 1-rank gloo mesh whose `device_type`
is patched to report "cuda" after the optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from grpo_cli.train.weights import offload as offload_mod
from grpo_cli.train.weights.offload import TrainingStateOffload
from grpo_cli.train.weights.offload_meter import moved_bytes


def _fsdp2_trained():
    """A `fully_shard`ed module on a CPU mesh after one AdamW step, gradients of a second backward left in place."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 8)).pow(2).sum().backward()
        if not opt.state:
            opt.step()
    return model, opt, mesh


def test_dtensor_state_offloaded_under_a_cuda_mesh_lands_on_the_host(one_rank_group, monkeypatch):
    model, opt, mesh = _fsdp2_trained()
    numel = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(mesh, "_device_type", "cuda")  # FSDP2's mesh on a GPU machine
    assert mesh.device_type == "cuda"
    off = TrainingStateOffload(model, opt, optimizer_state=True, grads=True, params=False, force=True)
    off.offload()
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and all(isinstance(v, DTensor) and v.to_local().device.type == "cpu" for v in states)
    parked = list(off._grads.values())
    assert parked and all(isinstance(g, DTensor) and g.to_local().device.type == "cpu" for g in parked)
    assert off.moved_bytes == {"optimizer": 8 * numel, "grads": 4 * numel, "params": 0}
    off.reload()
    assert all(p.grad is not None and p.grad.to_local().device.type == "cpu" for p in model.parameters())


def test_a_copy_left_off_the_host_is_not_counted_as_moved():
    """The place now holds a new storage on the GPU (what `from_local`'s move made of the host copy): it stayed."""
    before = {("state", 1, "exp_avg"): ("optimizer", ("cuda:0", 100), 64), ("grad", 2): ("grads", ("cuda:0", 200), 32)}
    stayed = {("state", 1, "exp_avg"): ("optimizer", ("cuda:0", 300), 64), ("grad", 2): ("grads", ("cuda:0", 400), 32)}
    assert moved_bytes(before, stayed) == {"optimizer": 0, "grads": 0, "params": 0}
    landed = {("state", 1, "exp_avg"): ("optimizer", ("cpu", 300), 64)}  # the gradient's place: freed
    assert moved_bytes(before, landed) == {"optimizer": 64, "grads": 32, "params": 0}


def test_a_parked_gradient_that_did_not_move_is_not_counted(monkeypatch):
    """Gradients are parked outside their parameters; the meter looks at the parked copy, not at the empty `.grad`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    monkeypatch.setattr(offload_mod, "_copy", lambda tensor, device: tensor)  # a "copy" that stays where it was
    off = TrainingStateOffload(model, None, optimizer_state=False, grads=True, params=False, force=True)
    off.offload()
    assert all(p.grad is None for p in model.parameters())
    assert off.moved_bytes == {"optimizer": 0, "grads": 0, "params": 0}
    off.reload()
