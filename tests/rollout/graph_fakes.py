"""CUDA's graph calls on a CPU machine, for the hf decode's CUDA-graph branch (`runtime.accel.StepGraph`): the decode
runs for real on the CPU, and `fake_cuda` stands in for what CUDA alone can do. `FakeGraph` records the step
called between `capture_begin` and `capture_end` and `replay` calls it again into the captured outputs, as a graph
replay rewrites them; streams and events are no-ops; the cache flushes (`torch.cuda.empty_cache`, the pinned host
cache's) are counted."""

from __future__ import annotations

import contextlib
import types

import torch

from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.rollout.hf import decode_step
from grpo_cli.runtime import accel


class FakeGraph:
    """torch.cuda.CUDAGraph on CPU; `made` lists every graph of the test, `capturing` the one being captured."""

    made: list[FakeGraph] = []
    capturing: FakeGraph | None = None

    def __init__(self, keep_graph: bool = False) -> None:
        self.redo, self.replays, self.batch, self.pool_given = None, 0, None, None
        FakeGraph.made.append(self)

    def capture_begin(self, pool=None, **kwargs) -> None:
        FakeGraph.capturing, self.pool_given = self, pool

    def capture_end(self) -> None:
        FakeGraph.capturing = None

    def replay(self) -> None:
        self.replays += 1
        self.redo()

    def pool(self):
        return ("pool", id(self))


class Stream:
    current = None

    def __init__(self, device=None, **kwargs) -> None:
        self.device = device

    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def on_stream(stream):
    Stream.current = stream
    yield
    Stream.current = None


def fake_cuda(monkeypatch) -> types.SimpleNamespace:
    """Patch the lean step (recording what a capture captured), torch.cuda's streams, graphs, events and cache
    flushes, and make the decode see CUDA. Returns `calls` (warmup: steps run on the side stream outside a capture;
    flushes: cache flushes)."""
    FakeGraph.made, FakeGraph.capturing = [], None
    calls = types.SimpleNamespace(warmup=0, flushes=[])
    real = decode_step.decode_sample

    def step(*args, **kwargs):
        out = real(*args, **kwargs)
        graph = FakeGraph.capturing
        if graph is not None:
            graph.batch = args[3].shape[0]
            graph.redo = lambda: [o.copy_(n) for o, n in zip(out, real(*args, **kwargs), strict=True)]
        elif Stream.current is not None:
            calls.warmup += 1
        return out

    monkeypatch.setattr(decode_mod, "decode_sample", step)
    monkeypatch.setattr(decode_mod, "is_cuda", lambda device: True)
    monkeypatch.setattr(accel, "is_cuda", lambda device: True)
    monkeypatch.setattr(accel, "_CAPTURE_STREAMS", {}, raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.flushes.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.flushes.append("host"), raising=False)
    # the finished count's read (accel.HostReadback) on its CUDA branch: an event, a host buffer (pinning needs CUDA)
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda: None, synchronize=lambda: None))
    real_host_copy = accel.host_copy
    monkeypatch.setattr(accel, "host_copy", lambda t, *, pinned: real_host_copy(t, pinned=False))
    return calls
