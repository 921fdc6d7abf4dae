"""GPU memory figures: `memory/cuda_peak_allocated_mb` and `memory/cuda_peak_reserved_mb` per step (and the allocated
peak per phase), restarted every step, the max over ranks, the run's largest in summary.json, shown by the live
view and `grpo report`. The CUDA branch runs on CPU with torch.cuda's peak-memory calls patched."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from dist_env import run_two_ranks
from rich.console import Console
from typer.testing import CliRunner

from grpo_cli.runtime import accel
from grpo_cli.train.supervise.timing import PhaseTimer

CUDA = torch.device("cuda", 0)
MB = 2**20
WORKER = str(Path(__file__).parents[1] / "launch" / "mean_metrics_worker.py")


class FakeAllocator:
    """torch.cuda's peak counters over a scripted allocator: `use(mb)` sets what is in use (the peak follows), the
    reserve is twice that; `reset_peak_memory_stats` restarts the peaks from what is in use, as CUDA's caching
    allocator does. The device (`mem_get_info`) holds the reserve less `unmapped` (a sleeping vLLM engine's pool,
    still on the allocator's books) plus `context` (CUDA's own, on no book)."""

    def __init__(self, monkeypatch) -> None:
        self.in_use = self.peak = 10 * MB
        self.unmapped, self.context, self.total = 0, 500 * MB, 80_000 * MB
        self.resets: list = []
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2 * self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * self.in_use)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.used(), self.total))

    def used(self) -> int:
        return 2 * self.in_use - self.unmapped + self.context

    def use(self, mb: float) -> None:
        self.in_use = int(mb * MB)
        self.peak = max(self.peak, self.in_use)

    def reset(self, device=None) -> None:
        self.resets.append(device)
        self.peak = self.in_use


def test_accel_reads_and_resets_cuda_peaks(monkeypatch):
    fake = FakeAllocator(monkeypatch)
    fake.use(300)
    assert accel.peak_memory_mb(CUDA) == {"allocated": 300.0, "reserved": 600.0}
    fake.use(20)
    accel.reset_peak_memory(CUDA)
    assert fake.resets == [CUDA] and accel.peak_memory_mb(CUDA) == {"allocated": 20.0, "reserved": 40.0}
    assert accel.peak_memory_mb(torch.device("cpu")) == {}  # the CPU: no allocator to read, never torch.cuda
    accel.reset_peak_memory(torch.device("cpu"))
    assert fake.resets == [CUDA]


def test_peaks_per_step_and_per_phase_restart_each_step(monkeypatch):
    fake = FakeAllocator(monkeypatch)
    fake.use(5000)  # model loading: before the timer, not the first step's
    fake.use(100)
    timer = PhaseTimer(CUDA)
    with timer.phase("generate"):
        fake.use(300)
        fake.use(150)
    fake.use(800)  # between phases (building the batch): the step's peak, no phase's
    fake.use(150)
    with timer.phase("train"):
        fake.use(700)
        fake.use(150)
    out = timer.pop()
    assert out["memory/cuda_peak_allocated_mb"] == 800 and out["memory/cuda_peak_reserved_mb"] == 1600
    assert out["memory/cuda_peak_allocated_mb/generate"] == 300 and out["memory/cuda_peak_allocated_mb/train"] == 700
    assert out["memory/cuda_peak_device_mb"] == 1600 + 500 and out["memory/cuda_peak_device_mb/train"] == 1400 + 500
    with timer.phase("sync"):
        fake.use(200)
    out = timer.pop()  # the next step: restarted from what was in use
    assert out["memory/cuda_peak_allocated_mb"] == 200 and set(out) == {
        "time/sync", "memory/cuda_peak_allocated_mb", "memory/cuda_peak_reserved_mb", "memory/cuda_peak_device_mb",
        "memory/cuda_peak_allocated_mb/sync", "memory/cuda_peak_device_mb/sync"}


def test_the_device_peak_leaves_out_a_sleeping_engines_pool_the_allocator_still_counts(monkeypatch):
    """Issue 46 (4.5): colocated vLLM allocates through a torch MemPool and its sleep unmaps the memory while the
    allocator's books keep it, so `cuda_peak_allocated_mb/train` counted the sleeping engine's 4000 MB and could not
    show whether training fits. The device's own figure does not count it, and the engine's sleep and wake take a
    reading on each side (`accel.memory_changing`), so generate's figure is the awake engine's."""
    fake = FakeAllocator(monkeypatch)
    fake.use(100)  # the trainer's resident state
    timer = PhaseTimer(CUDA)
    with timer.phase("generate"):
        fake.use(4100)  # the engine's pool (4000 MB, reserve 8000) mapped, awake
        fake.use(4400)  # sampling
        fake.use(4100)
        accel.memory_changing()  # VLLMEngine.sleep, before the unmapping
        fake.unmapped = 8000 * MB  # asleep: off the device, on the books
    with timer.phase("train"):
        fake.use(4800)  # training's 700 MB beside the sleeping pool
        fake.use(4100)
    with timer.phase("sync"):
        fake.unmapped = 0  # the engine wakes (VLLMEngine.wake_up, then its reading)
        accel.memory_changing()
        fake.use(4200)
    out = timer.pop()
    assert out["memory/cuda_peak_allocated_mb/train"] == 4800  # the allocator's books: the sleeping pool counted
    assert out["memory/cuda_peak_device_mb/train"] == 2 * 800 + 500  # the device: training and context only
    assert out["memory/cuda_peak_device_mb/generate"] == 2 * 4400 + 500  # the awake engine counted
    assert out["memory/cuda_peak_device_mb/sync"] == 2 * 4200 + 500
    assert out["memory/cuda_peak_device_mb"] == 2 * 4400 + 500 < out["memory/cuda_peak_reserved_mb"] + 500


def test_cpu_timer_logs_no_cuda_figures(monkeypatch):
    fake = FakeAllocator(monkeypatch)
    timer = PhaseTimer()
    with timer.phase("train"):
        pass
    assert list(timer.pop()) == ["time/train"] and fake.resets == []


def test_ranks_give_their_max_peaks_and_mean_of_the_rest(tmp_path):
    zero, one = run_two_ranks(WORKER, [], tmp_path, timeout=120)
    assert zero == one
    assert zero["loss"] == 1.5 and zero["time/step"] == 3.0
    assert zero["memory/cuda_peak_allocated_mb"] == 400 and zero["memory/cuda_peak_reserved_mb"] == 900
    assert zero["memory/cuda_peak_allocated_mb/train"] == 100 and zero["memory/peak_rss_mb"] == 2001


def test_run_dir_summary_peaks_cover_a_resumed_runs_earlier_steps(tmp_path):
    from grpo_cli.config.load import build_config
    from grpo_cli.train.supervise.run_dir import RunDir

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "memory/cuda_peak_allocated_mb": 900.0}) + "\n{half")
    rd = RunDir(run, build_config())
    rd.log_step(2, {"memory/cuda_peak_allocated_mb": 500.0, "memory/cuda_peak_reserved_mb": 1000.0}, [])
    rd.close()
    assert rd.peaks == {"memory/cuda_peak_allocated_mb": 900.0, "memory/cuda_peak_reserved_mb": 1000.0}


def test_cpu_live_view_shows_rss_only():
    from grpo_cli.ui.live_parts import memory_line, memory_plain

    assert memory_line({"loss": 1.0}) is None and memory_plain({}) == ""
    assert str(memory_line({"memory/peak_rss_mb": 3456.4})) == "memory RSS 3456 MB"
    assert memory_plain({"memory/peak_rss_mb": 3456.4}) == " rss=3456MB"


def _text(renderable) -> str:
    out = Console(file=io.StringIO(), width=200, color_system=None, force_terminal=True)
    out.print(renderable)
    return out.file.getvalue()


def test_cuda_peaks_reach_metrics_summary_live_view_and_report(tmp_path, tiny_checkpoint, monkeypatch):
    """A real tiny run whose timer reads a (patched) CUDA allocator: every step logs both peaks and the phases',
    summary.json holds the largest, the live view and its log line show them, and `grpo report` lists them."""
    from grpo_cli.cli.main import app
    from grpo_cli.config.load import build_config
    from grpo_cli.train import run as run_module
    from grpo_cli.ui.progress import ProgressView

    calls = iter(range(1, 10**6))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: (100 + next(calls)) * MB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4096 * MB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4000 * MB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70_000 * MB, 80_000 * MB))
    monkeypatch.setattr(run_module, "PhaseTimer", lambda device: PhaseTimer(CUDA))
    cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}", "train.steps=2",
                                  "train.prompts_per_step=2", "train.micro_batch_size=16"])
    console = Console(file=io.StringIO(), width=400, color_system=None)
    with ProgressView(2, mode="plain", console=console, log_path=tmp_path / "train.log") as view:
        summary = run_module.run_training(cfg, output_dir=str(tmp_path / "run"), reporter=view)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    allocated = [r["memory/cuda_peak_allocated_mb"] for r in rows]
    assert len(rows) == 2 and all(a > 100 for a in allocated)
    assert all(r["memory/cuda_peak_reserved_mb"] == 4096 and r["memory/cuda_peak_allocated_mb/train"] > 100
               and "memory/cuda_peak_allocated_mb/generate" in r for r in rows)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["memory/cuda_peak_allocated_mb"] == summary["memory/cuda_peak_allocated_mb"] == max(allocated)
    assert on_disk["memory/cuda_peak_reserved_mb"] == 4096 and on_disk["memory/peak_rss_mb"] > 0
    device = 10_000 + 96  # in use now, plus the reserve's peak above its present holding
    assert on_disk["memory/cuda_peak_device_mb"] == device and all(r["memory/cuda_peak_device_mb/train"] == device
                                                                  for r in rows)
    live = _text(view.render())
    assert (f"GPU peak {device} MB in use, allocator {allocated[-1]:.0f} MB allocated / 4096 MB reserved (by phase:"
            in live and f"train {device}" in live)
    assert f"gpu_mem={allocated[-1]:.0f}/4096MB gpu_used={device}MB" in console.file.getvalue()
    assert f"gpu_mem={allocated[0]:.0f}/4096MB gpu_used={device}MB" in (tmp_path / "train.log").read_text()
    report = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--no-plots"])
    assert report.exit_code == 0, report.output
    assert "GPU cuda_peak_allocated (MB)" in report.output and "GPU cuda_peak_reserved (MB)" in report.output
    assert "GPU cuda_peak_device (MB)" in report.output
    assert "GPU peak MB" in report.output  # the phase table's column
    info = json.loads(CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--json", "--no-plots"]).output)
    assert info["metrics"]["memory/cuda_peak_allocated_mb"]["max"] == max(allocated)
    assert info["phases"]["train"]["peak_allocated_mb"] == max(r["memory/cuda_peak_allocated_mb/train"] for r in rows)


@pytest.fixture(autouse=True)
def _no_cuda_leak():
    yield
    assert not torch.cuda.is_initialized()  # the patched calls never reached the real CUDA runtime
