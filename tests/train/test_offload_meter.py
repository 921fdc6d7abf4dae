"""The offload reports what it moved, measured from the tensors' storage, not what the config asked: plain modules
move exactly the selected state; DeepSpeed ZeRO-3 with its CPU optimizer moves no optimizer bytes and, of the
gradients, only the reduce bucket (its gradient partitions live in host memory already and stay there); and what
DeepSpeed allocates per kind equals `grpo plan`'s GPU + host rows for it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_env import clean_env
from offload_meter_worker import ZERO3_CPU_OPTIMIZER

from grpo_cli.config.load import build_config
from grpo_cli.config.model_shape import model_shape
from grpo_cli.planner.plan import host_plan, memory_plan
from grpo_cli.train.weights.offload import TrainingStateOffload
from grpo_cli.train.weights.offload_meter import held_bytes, moved_bytes, snapshot

WORKER = str(Path(__file__).with_name("offload_meter_worker.py"))


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 16)).pow(2).sum().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize(("optimizer", "grads", "params"), [(True, True, False), (False, False, True),
                                                           (True, False, False)])
def test_moved_bytes_are_the_selected_state(optimizer, grads, params):
    model, opt = _trained()
    numel = sum(p.numel() for p in model.parameters())
    off = TrainingStateOffload(model, opt, optimizer_state=optimizer, grads=grads, params=params, force=True)
    off.offload()
    # fp32: AdamW's two moments, the gradients, the parameters (moving parameters parks their gradients too)
    assert off.moved_bytes == {"optimizer": 8 * numel if optimizer else 0, "grads": 4 * numel if grads or params
                               else 0, "params": 4 * numel if params else 0}
    off.reload()
    assert held_bytes(snapshot(model, opt)) == {"optimizer": 8 * numel, "grads": 4 * numel, "params": 4 * numel}


def test_a_reused_address_does_not_hide_a_move():
    """Place a's storage moved away; a later allocation took its address for place b: a still moved, b too."""
    before = {("a",): ("grads", ("cpu", 100), 64), ("b",): ("grads", ("cpu", 200), 32)}
    after = {("a",): ("grads", ("cpu", 300), 64), ("b",): ("grads", ("cpu", 100), 32)}
    assert moved_bytes(before, after)["grads"] == 96
    # a flat buffer that stays while one of its views is dropped did not move
    views = {("flat",): ("params", ("cpu", 1), 400), ("view",): ("params", ("cpu", 1), 400)}
    assert moved_bytes(views, {("flat",): ("params", ("cpu", 1), 400)})["params"] == 0


def test_deepspeed_zero3_cpu_optimizer_moves_what_it_holds_on_the_gpu(tmp_path, tiny_checkpoint):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    out = tmp_path / "meter.json"
    subprocess.run([sys.executable, WORKER, tiny_checkpoint, str(out)], check=True, timeout=600,
                   env=clean_env(OMP_NUM_THREADS="1"))
    got = json.loads(out.read_text())
    assert got["flags"] == {"optimizer": False, "grads": True, "params": False}  # offload.optimizer: nothing to do
    assert got["moved"] == {"optimizer": 0, "grads": got["bucket_bytes"], "params": 0}
    assert got["bucket_bytes"] == 64 * 64 * 4  # reduce bucket hidden² (float32 model)
    assert got["grad_partitions_device"] == "cpu"
    # what DeepSpeed holds per kind is what `grpo plan` puts on the GPU plus on the host (1 process: no padding)
    cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}", *ZERO3_CPU_OPTIMIZER])
    mem = memory_plan(cfg, None)
    host = {k: b for k, (b, _) in host_plan(cfg, mem).items()}
    p = model_shape(tiny_checkpoint).params
    assert got["held"]["optimizer"] == mem["optimizer"] + host["optimizer"] == p * (4 + 8)  # masters + moments
    assert got["held"]["grads"] == mem["gradients"] + host["gradients"] == p * (4 + 4) + got["bucket_bytes"]
    assert got["held"]["params"] == mem["weights"] == p * 4
