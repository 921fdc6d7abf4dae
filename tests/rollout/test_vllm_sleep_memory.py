"""The colocated vLLM engine's sleep and wake take a memory reading on each side (`accel.memory_changing`), so the
trainer's device peaks (`memory/cuda_peak_device_mb`, tests/train/test_memory_metrics.py) never span an unmapping or
a mapping the allocator's books do not show (issue 46, 4.5). vLLM is a stand-in (`vllm_fakes.FakeLLM`)."""

from __future__ import annotations

from vllm_fakes import FakeLLM, bare_engine

from grpo_cli.runtime import accel


class Reader:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def mark(self) -> None:
        self.log.append("read")


def test_a_reading_before_each_sleep_and_after_each_wake(monkeypatch):
    log: list[str] = []
    llm = FakeLLM()
    monkeypatch.setattr(llm, "sleep", lambda level: log.append(f"sleep {level}"))
    monkeypatch.setattr(llm, "wake_up", lambda tags=None: log.append(f"wake {','.join(tags)}"))
    reader = Reader(log)
    accel.on_memory_change(reader.mark)
    engine = bare_engine(llm, sleep_level=1)
    engine.sleep(1)
    engine.sleep(1)  # asleep already: nothing unmapped, no reading
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    engine.wake_up()  # awake already
    assert log == ["read", "sleep 1", "wake weights", "read", "wake kv_cache", "read"]
    del reader  # held weakly: a finished run's reader is dropped, never called
    engine.sleep(1)
    assert log[6:] == ["sleep 1"]
