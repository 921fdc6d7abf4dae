#!/usr/bin/env bash
# Build the tiny reward model, then train against it. Extra arguments go to `grpo train`.
set -euo pipefail
cd "$(dirname "$0")"
python build_reward_model.py reward-model
grpo train --config config.yaml "$@"
