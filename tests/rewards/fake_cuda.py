"""A CUDA device in name only for the placement tests of judges and reward models: the host → device copies
(`accel.to_device`), the pinning (`Tensor.pin_memory`) and the cache flushes are recorded, nothing is allocated, so
the parked-model path a GPU takes runs here."""

from __future__ import annotations

import torch

from grpo_cli.rewards import model as rm_module
from grpo_cli.runtime import accel


class FakeCuda:
    """`copies`: (device, non_blocking) per tensor copied; `pinned`: how many tensors were page-locked; `emptied`:
    the devices whose cache was handed back; `entered`: how many times a model was placed (`rewards.model.placed`)."""

    def __init__(self, monkeypatch) -> None:
        self.copies: list[tuple[str, bool]] = []
        self.pinned, self.entered = 0, 0
        self.emptied: list[str] = []
        monkeypatch.setattr(accel, "to_device", self._copy)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor, *args: self._pin(tensor))
        monkeypatch.setattr(accel, "empty_cache", lambda device: self.emptied.append(str(device)))
        real = rm_module.placed

        def counted(*args, **kwargs):
            self.entered += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(rm_module, "placed", counted)

    def _copy(self, tensor, device, non_blocking=False):
        self.copies.append((str(device), non_blocking))
        return tensor  # stays in host memory: the device exists in name only

    def _pin(self, tensor):
        self.pinned += 1
        out = tensor.clone()
        out.is_pinned = lambda: True  # what a page-locked copy answers
        return out

    def moves(self, tensors: int) -> list[str]:
        """The whole-model moves, one entry per `tensors` copies (a model's parameters and buffers)."""
        assert len(self.copies) % tensors == 0, self.copies
        return [device for device, _ in self.copies[::tensors]]


def tensor_count(net) -> int:
    return len([*net.parameters(), *net.buffers()])
