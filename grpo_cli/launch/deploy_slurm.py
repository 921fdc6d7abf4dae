"""`deployment.scheduler: slurm` rendered: one sbatch script (config → text, a pure function) that starts the rollout
servers on the rollout nodes, waits for their /health, then runs the trainers with their rendezvous."""

from __future__ import annotations

import shlex

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import dump_config
from grpo_cli.config.schema import GRPOConfig

# The per-node part, run by each `srun` task: $1 is the node group, SLURM_PROCID the node's index in it (one task
# per node). Everything else comes from the batch part's environment, which srun passes on.
_NODE_SCRIPT = r"""set -euo pipefail
role="$1"
rank="${SLURM_PROCID:?run by srun}"
mkdir -p "$GRPO_SHARED_DIR/manifests"
# what `grpo doctor --mode multi-node` compares across nodes
grpo doctor --mode multi-node --write-manifest "$GRPO_SHARED_DIR/manifests/$role-$rank.json" --model {model}
if [[ "$role" == rollout ]]; then
  exec {serve}
fi
deadline=$((SECONDS + {timeout}))
for url in $GRPO_ROLLOUT_URLS; do
  until curl -sf -o /dev/null "$url/health"; do
    if ((SECONDS > deadline)); then echo "rollout server $url not healthy after {timeout} s" >&2; exit 1; fi
    sleep 2
  done
done
extra=()
if [[ -n "$GRPO_ROLLOUT_URLS" ]]; then
  urls="$(printf '"%s",' $GRPO_ROLLOUT_URLS)"
  extra=(--set "rollout.server.urls=[${urls%,}]")
fi
exec grpo train --config "$GRPO_SHARED_DIR/config.yaml" --nnodes {train_nodes} --node-rank "$rank" \
  --master-addr "$GRPO_MASTER_ADDR" --master-port {port} --output-dir "$GRPO_SHARED_DIR/run" "${extra[@]}"
"""


def serve_command(cfg: GRPOConfig) -> str:
    """The command one rollout node runs: every GPU of it serves (one engine per tensor-parallel group)."""
    dep, model = cfg.deployment, shlex.quote(cfg.model.name_or_path)
    n, tp = dep.rollout_engines_per_node, dep.rollout_tensor_parallel
    if dep.rollout_layout == "data_parallel":
        return (f"env VLLM_SERVER_DEV_MODE=1 vllm serve {model} --host 0.0.0.0 --port {dep.rollout_port} "
                f"--data-parallel-size {n} --tensor-parallel-size {tp} --max-model-len {cfg.max_sequence_length} "
                f"--gpu-memory-utilization {cfg.rollout.vllm.gpu_memory_utilization} --enable-scale-out --logprobs-mode processed_logprobs --no-enable-chunked-prefill "
                "--weight-transfer-config '{\"backend\": \"nccl\"}' "
                '${GRPO_ROLLOUT_TOKEN:+--api-key "$GRPO_ROLLOUT_TOKEN"}')
    dtype, util = cfg.model.dtype, cfg.rollout.vllm.gpu_memory_utilization
    return (f"grpo serve-rollout --engine {cfg.rollout.engine} --model {model} --host 0.0.0.0 "
            f"--port {dep.rollout_port} --data-parallel-size {n} --tensor-parallel-size {tp} --dtype {dtype} "
            f"--max-model-len {cfg.max_sequence_length} --seed {cfg.train.seed}"
            + (f" --gpu-memory-utilization {util}" if cfg.rollout.engine == "vllm" else ""))


def _node_script(cfg: GRPOConfig) -> str:
    dep = cfg.deployment
    return (_NODE_SCRIPT.replace("{serve}", serve_command(cfg)).replace("{model}", shlex.quote(cfg.model.name_or_path)).replace("{timeout}", str(dep.server_start_timeout_s))
            .replace("{train_nodes}", str(dep.train_nodes)).replace("{port}", str(cfg.distributed.main_process_port))
            )


def _batch_part(cfg: GRPOConfig) -> str:
    dep = cfg.deployment
    per_node = dep.rollout_engines_per_node if dep.rollout_layout == "servers" else 1  # URLs per rollout node
    return f"""nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null || tr ',' ' ' <<<"$SLURM_JOB_NODELIST"))
train=("${{nodes[@]:0:{dep.train_nodes}}}")
rollout=("${{nodes[@]:{dep.train_nodes}:{dep.rollout_nodes}}}")
export GRPO_MASTER_ADDR="${{train[0]}}"
port={dep.rollout_port}
GRPO_ROLLOUT_URLS=""
for h in "${{rollout[@]}}"; do for ((i = 0; i < {per_node}; i++)); do GRPO_ROLLOUT_URLS+=" http://$h:$((port + i))"; done; done
export GRPO_ROLLOUT_URLS
export GRPO_ROLLOUT_TOKEN="${{GRPO_ROLLOUT_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')}}"
"""


def render_slurm(cfg: GRPOConfig) -> str:
    """The whole sbatch script for `cfg.deployment` (scheduler slurm)."""
    dep = cfg.deployment
    if dep.rollout_nodes and cfg.rollout.server.urls:
        raise UserError("rollout.server.urls is derived from the rollout nodes under deployment.rollout_nodes > 0 "
                          "(their names and deployment.rollout_port); remove the typed URLs.")
    extra = "".join(f"#SBATCH {opt}\n" for opt in dep.sbatch_options)
    steps = ""
    if dep.rollout_nodes:
        steps += (f'srun --nodes={dep.rollout_nodes} --ntasks={dep.rollout_nodes} --ntasks-per-node=1 '
                  f'--nodelist="$(IFS=,; echo "${{rollout[*]}}")" bash "$GRPO_SHARED_DIR/node.sh" rollout &\n'
                  "servers=$!\n")
    steps += (f'srun --nodes={dep.train_nodes} --ntasks={dep.train_nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 '
              f'--nodelist="$(IFS=,; echo "${{train[*]}}")" bash "$GRPO_SHARED_DIR/node.sh" train && code=0 || code=$?\n')
    if dep.rollout_nodes:
        steps += 'kill "$servers" 2>/dev/null || true  # the servers outlive training otherwise\nwait "$servers" || true\n'
    return f"""#!/usr/bin/env bash
# Generated from the `deployment:` block of preset '{cfg.preset}' by `grpo train --dry-run --write-script FILE`; regenerate, do not edit.
# {dep.train_nodes} training node(s) x {cfg.distributed.num_processes} process(es), {dep.rollout_nodes} rollout node(s) x {dep.gpus_per_node} GPU(s).
#SBATCH --job-name=grpo
#SBATCH --nodes={dep.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={dep.gpus_per_node}
#SBATCH --exclusive
{extra}set -euo pipefail
export GRPO_SHARED_DIR="${{GRPO_SHARED_DIR:-{dep.shared_dir}}}"  # every node must see it
mkdir -p "$GRPO_SHARED_DIR"
cat > "$GRPO_SHARED_DIR/config.yaml" <<'GRPO_CONFIG'
{dump_config(cfg).rstrip()}
GRPO_CONFIG
cat > "$GRPO_SHARED_DIR/node.sh" <<'GRPO_NODE'
{_node_script(cfg).rstrip()}
GRPO_NODE
{_batch_part(cfg)}{steps}exit "$code"
"""
