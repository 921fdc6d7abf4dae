"""`grpo plan`'s deployment rows: each node group of `deployment:` (training, rollout) with what runs there and its
memory per GPU (the training figures are planner/plan.py's, for the job's real number of training nodes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.config.model_shape import model_shape
from grpo_cli.planner.plan import GIB, engine_bytes, memory_plan, peak_bytes

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig


def training_view(cfg: GRPOConfig) -> GRPOConfig:
    """`cfg` as each training node runs it: `deployment.train_nodes` machines (the script's --nnodes); `cfg`
    itself without a scheduler."""
    if cfg.deployment.scheduler == "none":
        return cfg
    dist = cfg.distributed.model_copy(update={"num_machines": cfg.deployment.train_nodes})
    return cfg.model_copy(update={"distributed": dist})


def rollout_gpu_bytes(cfg: GRPOConfig, gpu_mem: float | None) -> dict[str, float]:
    """Per rollout GPU: its share of one engine's weights (1/TP) and the KV cache vLLM takes up to its memory
    utilisation (`rollout.vllm.gpu_memory_utilization` of `--gpu-mem`, 80 GiB when not given); hf: weights only."""
    dep = cfg.deployment
    weights = model_shape(cfg.model.name_or_path).params * engine_bytes(cfg) / dep.rollout_tensor_parallel
    if cfg.rollout.engine == "hf":
        return {"weights": weights}
    budget = cfg.rollout.vllm.gpu_memory_utilization * (gpu_mem or 80 * GIB)
    return {"weights": weights, "kv_cache": max(0.0, budget - weights)}


def deployment_lines(cfg: GRPOConfig, gpu_mem: float | None) -> list[str]:
    """The node groups, or nothing under `deployment.scheduler: none`."""
    dep, d = cfg.deployment, cfg.distributed
    if dep.scheduler == "none":
        return []
    peak = peak_bytes(cfg, memory_plan(training_view(cfg), gpu_mem))
    lines = [f"# deployment ({dep.scheduler}): {dep.nodes} node(s) x {dep.gpus_per_node} GPU(s), shared dir "
             f"{dep.shared_dir}",
             f"  {'training nodes':28s} {dep.train_nodes} x {d.num_processes} process(es) ({d.backend}), rendezvous "
             f"on the first at port {d.main_process_port}; peak {peak / GIB:.2f} GiB per GPU"]
    if dep.rollout_nodes:
        per_node = dep.rollout_engines_per_node if dep.rollout_layout == "servers" else 1
        mem = rollout_gpu_bytes(cfg, gpu_mem)
        what = ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in mem.items())
        server = ("grpo serve-rollout" if dep.rollout_layout == "servers" else "vllm serve") + (
            f" --data-parallel-size {dep.rollout_engines_per_node}")
        lines.append(f"  {'rollout nodes':28s} {dep.rollout_nodes} x {server} (engine {cfg.rollout.engine}, tp "
                     f"{dep.rollout_tensor_parallel}); {per_node * dep.rollout_nodes} URL(s) derived from ports "
                     f"{dep.rollout_port}..{dep.rollout_port + per_node - 1}; per GPU: {what}")
    elif dep.scheduler == "ray":
        lines.append(f"  {'ray':28s} {d.rollout_gpus} GPU(s) per training node visible to Ray for rollout actors")
    return lines
