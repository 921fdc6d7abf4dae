#!/usr/bin/env bash
# A one-machine Ray cluster for async mode (the same commands start the head of a multi-machine cluster;
# other machines join with `ray start --address HEAD_IP:6379`).
set -euo pipefail
ray start --head --node-ip-address "${RAY_HEAD_IP:-127.0.0.1}" --port "${RAY_PORT:-6379}" \
  --num-cpus "${RAY_NUM_CPUS:-2}" --include-dashboard false --disable-usage-stats "$@"
