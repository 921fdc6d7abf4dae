"""What an offload actually moved, measured rather than read from the config: every place the training state lives
(optimizer state and float32 masters, gradients, parameters; DeepSpeed's ZeRO buffers included) is recorded by
its storage before and after the offload, and a storage moved when every place that held it now holds a storage in
host memory, or nothing. A new storage on the device is a copy that stayed there, not a move (a DTensor rewrapped
with `DTensor.from_local` went back to its mesh's GPU, and the meter used to count it as offloaded).

Why: a backend may ignore a request (DeepSpeed under `offload_optimizer` keeps the optimizer state and the
gradient partitions in host memory already), so "asked to move the optimizer" and "moved the optimizer" differ.
The records hold integers only, never the tensors, so nothing is kept alive while the offload frees memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

KINDS = ("optimizer", "grads", "params")
"""The kinds of training state, named like `distributed.offload`'s flags."""
_DS_ATTRS = {
    "optimizer": ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"),  # ZeRO-3 / ZeRO-1/2 masters
    "grads": ("grad_partitions_flat_buffer", "averaged_gradients"),
    "params": ("lp_param_buffer", "bit16_groups_flat"),
}
"""Buffers a DeepSpeed ZeRO optimizer holds besides `optimizer.state` and the module's parameters."""

Snapshot = dict[tuple, tuple[str, tuple[str, int], int]]
"""place → (kind, storage id (device, address), storage bytes)."""


def _tensors(value, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) of a tensor or of the tensors inside lists, tuples and dicts (DeepSpeed's buffer lists)."""
    if torch.is_tensor(value):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, (*path, i))


def _places(model: torch.nn.Module, optimizer, parked: dict) -> Iterator[tuple[tuple, str, torch.Tensor | None]]:
    """(place, kind, tensor or None) for every place the training state can live (a gradient parked outside its
    parameter, `parked[param]`, in its parameter's place)."""
    for p in model.parameters():
        yield ("param", id(p)), "params", p
        yield ("ds_tensor", id(p)), "params", getattr(p, "ds_tensor", None)
        yield ("grad", id(p)), "grads", p.grad if p.grad is not None else parked.get(p)
    if optimizer is None:
        return
    for owner, state in getattr(optimizer, "state", {}).items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:  # scalar `step` counters are not state worth moving
                yield ("state", id(owner), key), "optimizer", value
    for kind, names in _DS_ATTRS.items():
        for name in names:
            for index, tensor in _tensors(getattr(optimizer, name, None)):
                yield ("ds", name, index), kind, tensor
    for name, bucket in (getattr(optimizer, "ipg_buckets", None) or {}).items():  # ZeRO-3's reduce buckets
        yield ("ds", "ipg_buckets", str(name)), "grads", getattr(bucket, "buffer", None)
    for i, master in enumerate(getattr(optimizer, "fp32_partitioned_groups_flat", None) or []):
        yield ("ds", "fp32_grad", i), "grads", master.grad


def snapshot(model: torch.nn.Module, optimizer, *, parked: dict | None = None) -> Snapshot:
    """Where each piece of training state is stored now (tensors without storage or on `meta` are left out);
    `parked`: {parameter: its gradient, held outside the module while offloaded}."""
    out: Snapshot = {}
    for place, kind, tensor in _places(model, optimizer, parked or {}):
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
        if local.device.type == "meta" or local.numel() == 0:
            continue
        storage = local.untyped_storage()
        out[place] = (kind, (str(local.device), storage.data_ptr()), storage.nbytes())
    return out


def held_bytes(shot: Snapshot) -> dict[str, int]:
    """Bytes of distinct storages per kind (a storage reached from several places counts once)."""
    seen: dict[tuple[str, int], tuple[str, int]] = {}
    for kind, storage, nbytes in shot.values():
        seen.setdefault(storage, (kind, nbytes))
    out = dict.fromkeys(KINDS, 0)
    for kind, nbytes in seen.values():
        out[kind] += nbytes
    return out


def _on_host(storage: tuple[str, int]) -> bool:
    return storage[0] == "cpu"


def moved_bytes(before: Snapshot, after: Snapshot) -> dict[str, int]:
    """Bytes per kind whose storage left for the host: every place that held it before now holds another storage in
    host memory, or none (freed). A storage some place still holds stayed, even when other places let go of it
    (DeepSpeed empties its gathered views of a flat buffer that stays), and so did one whose place now holds a new
    storage off the host (a copy made on the device); comparing place by place, not address by address, keeps an
    address reused by a later allocation from hiding a move."""
    kept = {storage for place, (_, storage, _) in before.items()
            if (now := after.get(place)) and (now[1] == storage or not _on_host(now[1]))}
    moved: dict[tuple[str, int], tuple[str, int]] = {}
    for kind, storage, nbytes in before.values():
        if storage not in kept:
            moved.setdefault(storage, (kind, nbytes))
    out = dict.fromkeys(KINDS, 0)
    for kind, nbytes in moved.values():
        out[kind] += nbytes
    return out

