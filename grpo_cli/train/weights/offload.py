"""Training-state offload while the colocated engine generates: optimizer state, gradients and/or parameters
move to host memory before generation and back before training (`distributed.offload`)."""

from __future__ import annotations

import contextlib
import os
import time

import torch

from grpo_cli.runtime import accel
from grpo_cli.train.weights import offload_meter

FORCE_ENV = "GRPO_CLI_FORCE_OFFLOAD"
"""Set to 1 (by `grpo train --rehearse`): offload even on CPU, where the training state already is in host memory,
so the offload/reload path runs (through fresh host storage) as it would on a GPU."""
_DS_STATES = {"optimizer": ("optim_states", "hp_params"), "grads": ("lp_grads", "contiguous_grad_buffer"),
              "params": ("lp_params",)}


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


class TrainingStateOffload:
    """`offload()` before generation, `reload()` after; each returns the seconds it took (0 when idle).

    A no-op when nothing is selected or the training device already is `host` (CPU runs), unless `force` (tests
    round-trip the state through fresh host storage that way). A DeepSpeed engine is driven through its own
    `offload_states`/`reload_states`; FSDP2 parameters through `module.to` (torch swaps a DTensor parameter's
    contents in place, and `fully_shard`'s `_apply` re-points FSDP2 at the moved shard); plain modules, gradients
    and optimizer state tensor by tensor, a DTensor as its local shard (`_copy`). Parameters keep their identity
    (optimizer references stay valid); only their storage moves.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, optimizer_state: bool,
                 grads: bool, params: bool, host: str | torch.device = "cpu", force: bool = False) -> None:
        self.model, self.optimizer = model, optimizer
        self.flags = {"optimizer": optimizer_state and optimizer is not None, "grads": grads, "params": params}
        self.host = torch.device(host)
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else self.host
        self.active = any(self.flags.values()) and (force or self.device.type != self.host.type)
        self.offloaded = False
        self.moved_bytes: dict[str, int] = {}
        """Bytes per kind (optimizer, grads, params) the last offload actually moved (`offload_meter`)."""
        self._grads: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._homes: dict[tuple, torch.device] = {}

    @classmethod
    def from_config(cls, offload_cfg, model: torch.nn.Module, optimizer) -> TrainingStateOffload | None:
        """From `distributed.offload`; None when no flag is set. Forced on CPU when `FORCE_ENV` is 1."""
        if not (offload_cfg.optimizer or offload_cfg.grads or offload_cfg.params):
            return None
        return cls(model, optimizer, optimizer_state=offload_cfg.optimizer, grads=offload_cfg.grads,
                   params=offload_cfg.params, force=os.environ.get(FORCE_ENV) == "1")

    # ---- public ---------------------------------------------------------------------------------------

    def offload(self) -> float:
        if not self.active or self.offloaded:
            return 0.0
        start = time.perf_counter()
        before = offload_meter.snapshot(self.model, self.optimizer)
        if hasattr(self.model, "offload_states"):
            self._deepspeed_offload()
        else:
            self._move(to_host=True)
        after = offload_meter.snapshot(self.model, self.optimizer, parked=self._grads)
        self.moved_bytes = offload_meter.moved_bytes(before, after)
        accel.synchronize(self.device)
        accel.empty_cache(self.device)  # hand the freed blocks to the engine
        self.offloaded = True
        return time.perf_counter() - start

    def reload(self) -> float:
        if not self.offloaded:
            return 0.0
        start = time.perf_counter()
        if hasattr(self.model, "reload_states"):
            self.model.reload_states(non_blocking=False)
        else:
            self._move(to_host=False)
        accel.synchronize(self.device)
        self.offloaded = False
        return time.perf_counter() - start

    @contextlib.contextmanager
    def offloaded_state(self):
        """`with offloader.offloaded_state() as seconds:` … generate …; `seconds` holds offload + reload time."""
        seconds = {"offload": self.offload(), "reload": 0.0}
        try:
            yield seconds
        finally:
            seconds["reload"] = self.reload()

    # ---- movers ---------------------------------------------------------------------------------------

    def _deepspeed_offload(self) -> None:
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        # ZeRO-3 under offload_optimizer keeps its gradient partitions in host memory already; offloading them
        # copies them to a second pinned buffer and reload_states() then puts them on the GPU (DeepSpeed 0.19.8)
        on_host = {"lp_grads"} if getattr(self.optimizer, "offload_optimizer", False) else set()
        include = [getattr(OffloadStateTypeEnum, name) for key, names in _DS_STATES.items() if self.flags[key]
                   for name in names if name not in on_host]
        self.model.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=True,
                                  non_blocking=False)

    def _move(self, *, to_host: bool) -> None:
        params = list(self.model.parameters())
        if self.flags["optimizer"]:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:  # scalar `step` counters stay where they are
                        state[key] = self._relocate(("opt", id(state), key), value, to_host)
        # A parameter's .grad must live on the parameter's device, so gradients are parked outside the module.
        if to_host and (self.flags["grads"] or self.flags["params"]):
            for p in params:
                if p.grad is not None:
                    self._grads[p] = _copy(p.grad, self.host)
                    p.grad = None
        if self.flags["params"]:
            if any(_is_dtensor(p) for p in params):
                self.model.to(self.host if to_host else self.device)
            else:
                for p in params:
                    p.data = self._relocate(("param", id(p)), p.data, to_host)
        if not to_host:
            for p, grad in self._grads.items():
                p.grad = _copy(grad, p.device)
            self._grads.clear()
            self._homes.clear()

    def _relocate(self, key: tuple, tensor: torch.Tensor, to_host: bool) -> torch.Tensor:
        """Copy to the host remembering where `key` lived, or back to that home device."""
        if to_host:
            self._homes[key] = tensor.device
            return _copy(tensor, self.host)
        return _copy(tensor, self._homes.get(key, self.device))


def _copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of `tensor` in fresh storage on `device` (pinned when it is the host side of a device → host
    transfer, `accel.wants_pinned`). A DTensor (FSDP2 gradient or AdamW state) moves as its local shard, rewrapped
    with the same spec (mesh, placements, global shape): a plain tensor of the global shape cannot take its copy.

    Not `DTensor.from_local`: it moves the local tensor to the mesh's device type, and FSDP2's mesh on a GPU machine
    is `cuda`, so the host copy went straight back to the GPU (nothing offloaded). The DTensor is built around the
    copy as FSDP2 builds its own host shards under `CPUOffloadPolicy` (`_fsdp_common._from_local_no_grad`)."""
    if _is_dtensor(tensor):
        from torch.distributed.tensor import DTensor

        local = _copy(tensor.to_local(), device)
        return DTensor(local, tensor._spec, requires_grad=tensor.requires_grad)
    if accel.wants_pinned(tensor.device, device):
        return accel.host_copy(tensor, pinned=True)
    return tensor.to(device, copy=True, non_blocking=True)
