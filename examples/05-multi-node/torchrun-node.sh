#!/usr/bin/env bash
# Plain two-node launch without a scheduler: run on each machine with its rank and machine 0's address,
#   machine 0: bash examples/05-multi-node/torchrun-node.sh 0 10.0.0.1
#   machine 1: bash examples/05-multi-node/torchrun-node.sh 1 10.0.0.1
# `grpo train` relaunches itself through torchrun (distributed.launcher=torchrun) with --nnodes/--node_rank/
# --master_addr set from these options. DRY_RUN=1 prints the config, plan and torchrun command only.
set -euo pipefail
NODE_RANK="${1:?usage: torchrun-node.sh NODE_RANK MASTER_ADDR [grpo train options]}"
MASTER_ADDR="${2:?usage: torchrun-node.sh NODE_RANK MASTER_ADDR [grpo train options]}"
shift 2
grpo train --preset "${PRESET:-qwen-7b-colocate-tp2}" --set distributed.launcher=torchrun \
  --nnodes 2 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
  --output-dir "${OUT:-runs/grpo}" ${DRY_RUN:+--dry-run} "$@"
