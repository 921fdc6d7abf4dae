#!/usr/bin/env bash
# One node's part of the Slurm job (grpo.sbatch runs it once per node). Needs SLURM_NNODES, SLURM_NODEID,
# MASTER_ADDR (and optionally MASTER_PORT, PRESET, OUT). DRY_RUN=1 prints the config, plan and launch command only.
set -euo pipefail
grpo train --preset "${PRESET:-qwen-7b-colocate-tp2}" \
  --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \
  --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
  --output-dir "${OUT:-runs/grpo}" ${DRY_RUN:+--dry-run} "$@"
