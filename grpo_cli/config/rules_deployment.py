"""Cross-field rules of `deployment:`: the node groups, the scheduler and the rollout mode must describe one job."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_cli.config.sections import GRPOSections

_SERVE_ROLLOUT_ENGINES = ("hf", "vllm")  # what `grpo serve-rollout --data-parallel-size` starts


def check_deployment(cfg: GRPOSections) -> None:
    """Raise ValueError naming the `deployment.*` field and the fix."""
    dep, rollout = cfg.deployment, cfg.rollout
    if dep.scheduler == "none":
        if dep.rollout_nodes:
            raise ValueError(
                f"deployment.rollout_nodes={dep.rollout_nodes} needs a script to start them: set "
                "deployment.scheduler=slurm (rollout servers) or ray (async actors), or rollout_nodes=0.")
        return
    if dep.gpus_per_node % dep.rollout_tensor_parallel:
        raise ValueError(
            f"deployment.rollout_tensor_parallel={dep.rollout_tensor_parallel} must divide deployment.gpus_per_node="
            f"{dep.gpus_per_node} (each rollout engine takes that many of a node's GPUs).")
    if cfg.distributed.num_processes > dep.gpus_per_node:
        raise ValueError(
            f"distributed.num_processes={cfg.distributed.num_processes} (training processes per node) exceeds "
            f"deployment.gpus_per_node={dep.gpus_per_node}; lower it or raise gpus_per_node.")
    if dep.scheduler == "ray":
        if rollout.mode != "async":
            raise ValueError(
                f"deployment.scheduler=ray bootstraps Ray for rollout.mode=async (and stream), not "
                f"'{rollout.mode}'; use scheduler=slurm for rollout servers.")
        if dep.rollout_nodes and rollout.ray.num_actors > dep.rollout_nodes * dep.gpus_per_node:
            raise ValueError(
                f"rollout.ray.num_actors={rollout.ray.num_actors} rollout actors take one GPU each, and the "
                f"{dep.rollout_nodes} rollout node(s) give Ray {dep.rollout_nodes * dep.gpus_per_node}; lower it.")
        return
    if dep.rollout_nodes and rollout.mode != "server":
        raise ValueError(
            f"deployment.rollout_nodes={dep.rollout_nodes} under scheduler=slurm start rollout servers, so "
            f"rollout.mode must be 'server' (it is '{rollout.mode}'); or set rollout_nodes=0 (colocated).")
    if dep.rollout_nodes and dep.rollout_layout == "servers" and rollout.engine not in _SERVE_ROLLOUT_ENGINES:
        raise ValueError(
            f"deployment.rollout_layout=servers starts `grpo serve-rollout` (engines hf, vllm), not rollout.engine "
            f"'{rollout.engine}'; for a stock `vllm serve` use engine vllm-serve with rollout_layout=data_parallel.")
    if dep.rollout_nodes and dep.rollout_layout == "data_parallel" and rollout.engine != "vllm-serve":
        raise ValueError(
            f"deployment.rollout_layout=data_parallel runs one `vllm serve --data-parallel-size N` per node, which "
            f"needs rollout.engine=vllm-serve (it is '{rollout.engine}'); or use rollout_layout=servers.")
    if dep.rollout_nodes and dep.rollout_layout == "servers" and dep.rollout_tensor_parallel != 1:
        raise ValueError(
            f"deployment.rollout_tensor_parallel={dep.rollout_tensor_parallel}: `grpo serve-rollout` (engines hf, vllm)"
            " serves one GPU per engine; for tensor-parallel engines use rollout.engine=vllm-serve with "
            "rollout_layout=data_parallel (one `vllm serve --data-parallel-size N --tensor-parallel-size TP` a node).")
    if dep.rollout_nodes and rollout.server.weight_transport in ("shm", "tensor"):
        raise ValueError(
            f"rollout.server.weight_transport={rollout.server.weight_transport} works on one host only, and "
            "deployment.rollout_nodes puts the servers on other nodes; use http or nccl.")
    if dep.rollout_layout == "data_parallel" and dep.rollout_nodes and rollout.server.weight_transport != "nccl":
        raise ValueError(
            "deployment.rollout_layout=data_parallel (stock `vllm serve` on other nodes) needs "
            "rollout.server.weight_transport=nccl (vLLM's NCCL engine; its shm plugin needs the same host).")
