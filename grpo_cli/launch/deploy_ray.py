"""`deployment.scheduler: ray` rendered: a per-node bootstrap script (config → text, a pure function) that starts one
Ray cluster in which only the rollout GPUs are visible, then the trainers (rollout.mode async).

Ray 2.60's `ray start --head` turns token authentication on by itself when a token file exists in its home
(`~/.ray/auth_token`), while a joining `ray start --address` presents one only with `RAY_AUTH_MODE=token`
(ray/_private/authentication/authentication_token_setup.py): a node whose home differs or holds no token cannot
join ("InvalidAuthToken"). So the script sets token mode on every node, node 0 writes a token (Ray's own form,
`secrets.token_hex(32)`) into the shared directory, readable by its owner only, and every node and trainer reads it
there (`RAY_AUTH_TOKEN_PATH`)."""

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
    cpus = " --num-cpus=0" if dep.rollout_nodes else ""  # with rollout nodes, no actor lands on a training node
    return f"""#!/usr/bin/env bash
# Generated from the `deployment:` block of preset '{cfg.preset}' by `grpo train --dry-run --write-script FILE`; regenerate, do not edit.
# Run on every node: bash grpo-ray.sh NODE_RANK HEAD_ADDR (nodes 0..{dep.train_nodes - 1} train, the other {dep.rollout_nodes} only generate).
# Under Slurm: srun --ntasks-per-node=1 bash grpo-ray.sh "$SLURM_NODEID" "$(scontrol show hostnames | head -n1)".
set -euo pipefail
rank="${{1:?NODE_RANK}}"; head="${{2:?HEAD_ADDR}}"
export GRPO_SHARED_DIR="${{GRPO_SHARED_DIR:-{dep.shared_dir}}}"  # every node must see it
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$GRPO_SHARED_DIR/ray/auth_token"  # node 0 writes it, all present it
mkdir -p "$GRPO_SHARED_DIR/manifests" "$GRPO_SHARED_DIR/ray"
grpo doctor --mode multi-node --write-manifest "$GRPO_SHARED_DIR/manifests/node-$rank.json" --model {shlex.quote(cfg.model.name_or_path)}
if ((rank == 0)); then
  [[ -s "$RAY_AUTH_TOKEN_PATH" ]] || (umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' \
    > "$RAY_AUTH_TOKEN_PATH.tmp" && mv "$RAY_AUTH_TOKEN_PATH.tmp" "$RAY_AUTH_TOKEN_PATH")
else
  until [[ -s "$RAY_AUTH_TOKEN_PATH" ]]; do sleep 2; done
fi
if ((rank >= {dep.train_nodes})); then  # a rollout node: all its GPUs and cores are Ray's
  exec ray start --address="$head:6379" --num-gpus={dep.gpus_per_node} --block
fi
if ((rank == 0)); then
  cat > "$GRPO_SHARED_DIR/config.yaml" <<'GRPO_CONFIG'
{dump_config(cfg).rstrip()}
GRPO_CONFIG
  CUDA_VISIBLE_DEVICES="{visible}" ray start --head --port=6379 --num-gpus={gpus}{cpus}
else
  CUDA_VISIBLE_DEVICES="{visible}" ray start --address="$head:6379" --num-gpus={gpus}{cpus}
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
