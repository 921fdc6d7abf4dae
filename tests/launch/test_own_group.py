"""A job of one process that needs a process group (fsdp2, DeepSpeed, megatron) makes its own 1-rank group, with no
launcher variable, and destroys it at the end of the job (`shutdown`), after letting DeepSpeed and Megatron drop
their cached subgroups; a launched job's group is left alone (issue 36: fsdp2 in one process raised torch's
"environment variable RANK expected", and single-process DeepSpeed/megatron runs never destroyed their group)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_env import clean_env

from grpo_cli.runtime import dist as gdist


@pytest.fixture()
def no_group():
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():  # a failed assertion must not leak the group into later tests
        dist.destroy_process_group()


def test_one_process_gets_a_group_that_shutdown_destroys(no_group, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    calls = []
    gdist.ensure_process_group(torch.device("cpu"), timeout_minutes=5, before_destroy=lambda: calls.append("drop"))
    group = dist.group.WORLD
    assert dist.get_world_size() == 1 and dist.get_rank() == 0 and dist.get_backend() == "gloo"
    gdist.ensure_process_group(torch.device("cpu"), timeout_minutes=5)  # a second backend: the same group
    assert dist.group.WORLD is group
    t = torch.ones(2)
    dist.all_reduce(t)  # a working group, not a placeholder
    assert t.tolist() == [1.0, 1.0]
    gdist.shutdown(gdist.DistInfo())
    assert not dist.is_initialized() and calls == ["drop"]
    assert gdist.release_own_group() is False  # nothing left to destroy


def test_a_group_made_elsewhere_is_not_destroyed(no_group):
    """A launched job's group (`init_from_env`), or a colocated vLLM's own: ensure adds nothing, release destroys
    nothing and runs no callback."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    calls = []
    gdist.ensure_process_group(torch.device("cpu"), timeout_minutes=5, before_destroy=lambda: calls.append("drop"))
    assert gdist.release_own_group() is False and dist.is_initialized() and calls == []


def test_cuda_group_of_one_is_nccl_plus_gloo_without_a_bound_device(monkeypatch):
    """The GPU branch, patched: the device is set first, then `cpu:gloo,cuda:nccl` with the configured timeout on
    an in-memory store, rank 0 of 1, and no `device_id` (torch would build later groups with ncclCommSplit)."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(dist, "is_initialized", lambda: any(c[0] == "init" for c in calls))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    gdist.ensure_process_group(torch.device("cuda", 0), timeout_minutes=33)
    assert [c[0] for c in calls] == ["set_device", "init"] and calls[0][1] == torch.device("cuda", 0)
    kw = calls[1][1]
    assert kw["backend"] == "cpu:gloo,cuda:nccl" and "device_id" not in kw
    assert (kw["rank"], kw["world_size"], kw["timeout"]) == (0, 1, timedelta(minutes=33))
    assert isinstance(kw["store"], dist.HashStore)
    assert gdist.release_own_group() is False  # the patched init made no group to destroy


_TWO_JOBS = """
import sys, torch, torch.distributed as dist
from grpo_cli.runtime.dist import DistInfo, shutdown
kind = sys.argv[1]
if kind == "deepspeed":
    from deepspeed.utils import groups
    from grpo_cli.train.backends.deepspeed import ensure_process_group

    def job():
        ensure_process_group(torch.device("cpu"), timeout_minutes=5)
        return groups._get_data_parallel_group()  # cached by DeepSpeed, as ZeRO does
else:
    from megatron.core import parallel_state as mpu
    from grpo_cli.config.load import build_config
    from grpo_cli.train.backends.megatron.build import init_parallel_state
    cfg = build_config(overrides=["distributed.backend=megatron"])

    def job():
        init_parallel_state(cfg, 1, torch.device("cpu"))
        return mpu.get_data_parallel_group()
for run in range(2):  # a second job in the same process (tests, notebooks) gets a fresh, working group
    group = job()
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    shutdown(DistInfo())
    print(run, float(t), dist.is_initialized(), flush=True)
"""


@pytest.mark.parametrize("kind", ["deepspeed", "megatron"])
def test_single_process_backends_destroy_their_group_at_shutdown(kind):
    module = {"deepspeed": "deepspeed", "megatron": "megatron.core"}[kind]
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    out = subprocess.run([sys.executable, "-c", _TWO_JOBS, kind], capture_output=True, text=True, timeout=180,
                         env=clean_env())
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert [line for line in out.stdout.splitlines() if line[:2] in ("0 ", "1 ")] == ["0 1.0 False", "1 1.0 False"], \
        out.stdout[-2000:]


def test_fsdp2_builds_and_steps_in_one_process(no_group, monkeypatch, tiny_checkpoint):
    """In-process and fast (the CLI runs are in tests/e2e/test_fsdp2_one_process.py): no launcher variable, the
    policy sharded over its own 1-rank group, one optimizer step moves it, and `shutdown` destroys the group."""
    from grpo_cli.config.load import build_config
    from grpo_cli.train.batch import TrainBatch
    from grpo_cli.train.policy import load_policy
    from grpo_cli.train.step import optimizer_step

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}", "distributed.backend=fsdp2",
                                  "distributed.fsdp2.cpu_offload=true", "rollout.mode=server",
                                  'rollout.server.urls=["http://127.0.0.1:1"]', "train.prompts_per_step=1",
                                  "train.generations_per_prompt=4", "train.micro_batch_size=4",
                                  "train.learning_rate=1e-2"])
    policy = load_policy(cfg, tiny_checkpoint, device=torch.device("cpu"), info=gdist.DistInfo())
    assert dist.is_initialized() and dist.get_world_size() == 1
    before = {n: p.full_tensor().clone() for n, p in policy.module.named_parameters()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, policy.module.config.vocab_size, (4, 9), generator=g)
    mask = torch.ones(4, 4)
    batch = TrainBatch(ids, torch.ones_like(ids), mask, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       sampler_logprobs=-torch.rand(4, 4, generator=g))
    optimizer_step(policy, batch, cfg, num_items=16.0, num_sequences=4)
    assert any(not torch.equal(before[n], p.full_tensor()) for n, p in policy.module.named_parameters())
    gdist.shutdown(gdist.DistInfo())
    assert not dist.is_initialized()


_FAILED_RUN = """
import sys, torch.distributed as dist
import grpo_cli.train.run as run
from grpo_cli.config.load import build_config

def boom(*args, **kwargs):
    assert dist.is_initialized()  # the backend made its 1-rank group
    raise RuntimeError("boom")

run.run_loop = boom
cfg = build_config(overrides=["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=2", "train.steps=1",
                              "model.name_or_path=" + sys.argv[1], "eval.every_steps=0"])
try:
    run.run_training(cfg, output_dir=sys.argv[2])
except RuntimeError as exc:
    print("raised", exc)
print("group left", dist.is_initialized(), flush=True)
"""


def test_a_failed_one_process_run_destroys_its_group(tmp_path, tiny_checkpoint):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    out = subprocess.run([sys.executable, "-c", _FAILED_RUN, tiny_checkpoint, str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=180, env=clean_env())
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "raised boom" in out.stdout and "group left False" in out.stdout, out.stdout[-2000:]
