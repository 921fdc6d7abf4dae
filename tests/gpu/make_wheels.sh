#!/usr/bin/env bash
# On a CPU machine with the test install of README ("Run the tests"): the wheels of what grpo-cli and the GPU suite
# import that a CUDA machine with torch and transformers alone lacks, for that machine's Python, into DIR (default
# .gpu-wheels), at the versions installed here, so they are the versions CI tested together. The set is
# tests/gpu/wheel_set.py's: pyproject's dependencies, the lora/deepspeed/megatron extras, pytest, psutil and pillow,
# with everything they require, minus its ON_IMAGE list (torch, transformers and their requirements; pyarrow and
# pandas, too large to carry). No vLLM, no Ray: far too large to carry. tests/layout/test_gpu_suite.py checks it.
# Usage: bash tests/gpu/make_wheels.sh [DIR]      (GPU_PYTHON=3.12 by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.gpu-wheels}
mkdir -p "$dir"
pins=$(python tests/gpu/wheel_set.py)
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
# shellcheck disable=SC2086
pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
  "${platforms[@]}" -d "$dir" $pins
# An sdist whose build imports torch (installed here): built once into a pure-Python wheel, its ops off.
DS_BUILD_OPS=0 pip wheel -q --no-deps --no-build-isolation "deepspeed==$(python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')" -w "$dir"
du -sh "$dir"
ls "$dir"
