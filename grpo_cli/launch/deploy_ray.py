"""`deployment.scheduler: ray` rendered: a per-node bootstrap script (config → text, a pure function) that starts one
Ray cluster in which only the rollout GPUs are visible, then the trainers (rollout.mode async)."""

from __future__ import annotations

import shlex

from grpo_cli.config.load import dump_config
from grpo_cli.config.schema import GRPOConfig


def _ray_gpus(cfg: GRPOConfig) -> tuple[str, str]:
    """(Ray's --num-gpus on a training node, the CUDA_VISIBLE_DEVICES Ray's raylet sees there)."""
    dep, d = cfg.deployment, cfg.distributed
    if dep.rollout_nodes:  # rollouts on their own nodes: the training GPUs stay out of Ray
        return "0", ""
    first = d.num_processes  # the training processes take GPUs 0..num_processes-1, Ray the next rollout_gpus
    return str(d.rollout_gpus), ",".join(str(first + i) for i in range(d.rollout_gpus))


def render_ray(cfg: GRPOConfig) -> str:
    """The bootstrap every node runs as `bash grpo-ray.sh NODE_RANK HEAD_ADDR` (node 0 first)."""
    dep, d = cfg.deployment, cfg.distributed
    gpus, visible = _ray_gpus(cfg)
    return f"""#!/usr/bin/env bash
# Generated from the `deployment:` block of preset '{cfg.preset}' by `grpo train --dry-run --write-script FILE`; regenerate, do not edit.
# Run on every node: bash grpo-ray.sh NODE_RANK HEAD_ADDR (nodes 0..{dep.train_nodes - 1} train, the other {dep.rollout_nodes} only generate).
# Under Slurm: srun --ntasks-per-node=1 bash grpo-ray.sh "$SLURM_NODEID" "$(scontrol show hostnames | head -n1)".
set -euo pipefail
rank="${{1:?NODE_RANK}}"; head="${{2:?HEAD_ADDR}}"
export GRPO_SHARED_DIR="${{GRPO_SHARED_DIR:-{dep.shared_dir}}}"  # every node must see it
mkdir -p "$GRPO_SHARED_DIR/manifests"
grpo doctor --mode multi-node --write-manifest "$GRPO_SHARED_DIR/manifests/node-$rank.json" --model {shlex.quote(cfg.model.name_or_path)}
if ((rank >= {dep.train_nodes})); then  # a rollout node: all its GPUs are Ray's
  exec ray start --address="$head:6379" --num-gpus={dep.gpus_per_node} --block
fi
if ((rank == 0)); then
  cat > "$GRPO_SHARED_DIR/config.yaml" <<'GRPO_CONFIG'
{dump_config(cfg).rstrip()}
GRPO_CONFIG
  CUDA_VISIBLE_DEVICES="{visible}" ray start --head --port=6379 --num-gpus={gpus}
else
  CUDA_VISIBLE_DEVICES="{visible}" ray start --address="$head:6379" --num-gpus={gpus}
fi
until [[ -f "$GRPO_SHARED_DIR/config.yaml" ]]; do sleep 2; done
exec grpo train --config "$GRPO_SHARED_DIR/config.yaml" --nnodes {dep.train_nodes} --node-rank "$rank" \\
  --master-addr "$head" --master-port {d.main_process_port} --output-dir "$GRPO_SHARED_DIR/run" \\
  --set rollout.ray.address=auto
"""


def render_deployment(cfg: GRPOConfig) -> str | None:
    """The script `cfg.deployment.scheduler` runs (None for `none`)."""
    if cfg.deployment.scheduler == "ray":
        return render_ray(cfg)
    if cfg.deployment.scheduler == "slurm":
        from grpo_cli.launch.deploy_slurm import render_slurm

        return render_slurm(cfg)
    return None
