#!/usr/bin/env bash
# On a CPU machine with the test install of README ("Run the tests"): the Python packages grpo-cli needs that a
# torch-only CUDA image lacks (the device tool's: torch, transformers, accelerate, peft, tokenizers, typer, rich,
# httpx, pandas, pyarrow, pytest...), as wheels for that image's Python, into DIR (default .gpu-wheels), at the
# versions installed here, so they are the versions CI tested together. No vLLM, no Ray: far too large to carry.
# Usage: bash tests/gpu/make_wheels.sh [DIR]      (GPU_PYTHON=3.12 by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.gpu-wheels}
mkdir -p "$dir"
pins=$(python - <<'PY'
import importlib.metadata as m
names = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "annotated-doc",
         "fastapi", "starlette", "uvicorn", "datasets", "dill", "multiprocess", "hjson", "py-cpuinfo",
         "megatron-core", "mbridge"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))
PY
)
# shellcheck disable=SC2086
pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" $pins
# An sdist whose build imports torch (installed here): built once into a pure-Python wheel, its ops off.
DS_BUILD_OPS=0 pip wheel -q --no-deps --no-build-isolation "deepspeed==$(python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')" -w "$dir"
du -sh "$dir"
ls "$dir"
