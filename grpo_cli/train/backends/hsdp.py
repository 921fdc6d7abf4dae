"""HSDP's device mesh (`distributed.fsdp2.replicate`): R replicas × S shard ranks, from process groups that carry the
job's collective timeout (`init_device_mesh` would make its subgroups with torch's default: 30 minutes on gloo)."""

from __future__ import annotations

from datetime import timedelta

import torch


def mesh_ranks(replicas: int, shard: int) -> torch.Tensor:
    """(R, S) global ranks: row r is replica r's shard group, ranks r·S … r·S + S − 1. Launchers number ranks node by
    node, so with S = GPUs per node a shard group is one node (its gathers and reduce-scatters stay on NVLink) and a
    column, one GPU of each node, all-reduces the replicas' gradients across nodes."""
    return torch.arange(replicas * shard, dtype=torch.int).view(replicas, shard)


def hsdp_mesh(device: torch.device, *, replicas: int, shard: int, timeout_minutes: float):
    """The 2-D `DeviceMesh` ("replicate", "shard") for `fully_shard(mesh=...)`, of the training device's type.
    Collective: every rank makes every subgroup, in one order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    layout, timeout = mesh_ranks(replicas, shard), timedelta(minutes=timeout_minutes)
    shard_group, _ = dist.new_subgroups_by_enumeration(layout.tolist(), timeout=timeout)
    replicate_group, _ = dist.new_subgroups_by_enumeration(layout.T.tolist(), timeout=timeout)
    return DeviceMesh.from_group([replicate_group, shard_group], device.type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))
