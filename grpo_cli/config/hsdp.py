"""HSDP (`distributed.fsdp2.replicate`): the replica × shard layout of fsdp2's device mesh, its config rule, and how
many processes share one copy of the sharded training state (what `grpo plan` divides by)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_cli.config.sections import GRPOSections as GRPOConfig


def mesh_shape(cfg: GRPOConfig) -> tuple[int, int]:
    """(replicas R, shard-group size world/R) of fsdp2's mesh; (1, world) is plain FSDP."""
    d = cfg.distributed
    world = d.num_processes * d.num_machines
    replicas = d.fsdp2.replicate if d.backend == "fsdp2" else 1
    return replicas, world // replicas


def shard_ranks(cfg: GRPOConfig) -> int:
    """Processes one copy of the sharded state (weights, gradients, optimizer) is split over: world/R under HSDP,
    the whole world otherwise."""
    return mesh_shape(cfg)[1]


def vocab_parallel(cfg: GRPOConfig, size: int | None = None) -> bool:
    """Whether fsdp2 shards the input embedding and output layer as a unit of their own that the sequence-parallel
    forward never gathers (`models.vocab_parallel`): `distributed.sequence_parallel.size` (or `size`, a split
    `grpo plan` weighs) > 1 over the whole mesh (the shard group is the sequence-parallel group: data parallel 1, no
    HSDP), shards on the training device (not `fsdp2.cpu_offload`)."""
    d = cfg.distributed
    replicas, shard = mesh_shape(cfg)
    size = size or d.sequence_parallel.size
    return d.backend == "fsdp2" and size > 1 and replicas == 1 and shard == size and not d.fsdp2.cpu_offload


def check_hsdp(cfg: GRPOConfig) -> None:
    """R must divide the processes (another backend with R > 1 is refused by the generic `distributed.fsdp2` rule)."""
    d = cfg.distributed
    world, replicas = d.num_processes * d.num_machines, d.fsdp2.replicate
    if d.backend == "fsdp2" and world % replicas:
        valid = [r for r in range(1, world + 1) if world % r == 0]
        raise ValueError(
            f"distributed.fsdp2.replicate={replicas} does not divide the {world} training processes "
            f"(num_processes {d.num_processes} x num_machines {d.num_machines}): HSDP lays them out as replicate x "
            f"shard-group ranks, every replica the same size. Use one of {valid}; the usual choice is "
            f"num_machines ({d.num_machines}), which shards inside each node and replicates across nodes."
        )


def layout_note(cfg: GRPOConfig) -> str | None:
    """`grpo plan`'s line for the mesh under HSDP; None for plain FSDP and other backends."""
    replicas, shard = mesh_shape(cfg)
    if replicas == 1:
        return None
    return (f"HSDP mesh: {replicas} replicas x {shard} shard ranks; weights, gradients and optimizer state 1/{shard} "
            f"per process; gradients reduce-scattered in the shard group, all-reduced across the {replicas} "
            "replicas")
