#!/usr/bin/env bash
# CI gate: fail the job when the rollout engine's logprobs drift from the trainer's beyond a bound.
# Exit 0 = within bounds, 1 = a gate failed (the table says which metric), 2 = bad input.
# Knobs: PRESET (default tiny-cpu), ENGINE (hf | vllm | server; default: the preset's), K3_MAX (default 1e-3),
# ESS_MIN (default 0.99), REPORT (JSON report path, default mismatch.json). Extra arguments go to the command.
set -euo pipefail
grpo diagnose-mismatch "${PRESET:-tiny-cpu}" ${ENGINE:+--engine "$ENGINE"} \
  --fail-above "k3_kl=${K3_MAX:-1e-3}" --fail-below "ess=${ESS_MIN:-0.99}" \
  --json "${REPORT:-mismatch.json}" "$@"
