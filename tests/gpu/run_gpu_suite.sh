#!/usr/bin/env bash
# On a CUDA machine that has torch but not the rest of grpo-cli's dependencies (the device tool's image): install the
# wheels of tests/gpu/make_wheels.sh into .site (no index, no network), then run the GPU suite from this checkout,
# without installing the project. Four tests at a time when pytest-xdist is there (the tests are subprocesses of a
# tiny model, so one GPU holds them all); within 10 minutes on one H100.
# Usage: bash tests/gpu/run_gpu_suite.sh [WHEELS_DIR] [pytest args...]     (WHEELS_DIR default .gpu-wheels)
set -euo pipefail
cd "$(dirname "$0")/../.."
wheels=${1:-.gpu-wheels}
shift || true
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site "$wheels"/*.whl
fi
export PYTHONPATH="$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, grpo_cli.cli.main; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
extra=()
python3 -c "import xdist" 2>/dev/null && extra+=(-n "${GPU_SUITE_WORKERS:-4}")
python3 -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 540)
exec python3 -m pytest tests/gpu -v -rs -p no:cacheprovider "${extra[@]}" "$@"
