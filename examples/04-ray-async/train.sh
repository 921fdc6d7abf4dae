#!/usr/bin/env bash
# Async GRPO on the Ray cluster started by start-cluster.sh: `rollout.ray.address: auto` joins it (RAY_ADDRESS,
# when set, picks the cluster). Environment knobs: STEPS (default 60), OUT (default runs/ray-async).
set -euo pipefail
grpo train --preset tiny-cpu-async --set rollout.ray.address=auto --set "train.steps=${STEPS:-60}" \
  --output-dir "${OUT:-runs/ray-async}" "$@"
