#!/usr/bin/env bash
# One prepared call of the device tool (docs/gpu-tests.md): the GPU benchmark (grpo-cli beside TRL), then the GPU
# suite in the time left, each under its own limit so both report inside one 10-minute call. Logs and results go to
# $OUT (default ./gpu-out). Carry .gpu-wheels (tests/gpu/make_wheels.sh, plus TRL's wheel).
# Usage: bash tests/gpu/device_call.sh [BENCH_SECONDS] [SUITE_SECONDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .gpu-wheels/*.whl || exit 1
export PYTHONPATH="$PWD/.site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
timeout "${1:-200}" python3 -m benchmarks.gpu_step --out "$out/gpu_step.json" 2>&1 | tee "$out/bench.log" | tail -30
echo "benchmark exit: $?"
timeout "${2:-330}" bash tests/gpu/run_gpu_suite.sh none -q --junitxml="$out/suite.xml" 2>&1 | tee "$out/suite.log" | tail -60
echo "suite exit: $?"
