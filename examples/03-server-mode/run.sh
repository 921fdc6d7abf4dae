#!/usr/bin/env bash
# Server mode on one box: start `grpo serve-rollout` with a bearer token, train against it, shut it down.
# Environment knobs: PORT (default 8000), STEPS (default 60), OUT (run directory, default runs/server-mode).
set -euo pipefail
PORT="${PORT:-8000}"
STEPS="${STEPS:-60}"
OUT="${OUT:-runs/server-mode}"
URL="http://127.0.0.1:${PORT}"
# one secret shared by both processes: the server requires it on every call but /health
export GRPO_ROLLOUT_TOKEN="${GRPO_ROLLOUT_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}"

mkdir -p "$OUT"
grpo serve-rollout --engine hf --model builtin:tiny --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT

python - "$URL" "$SERVER" <<'PY'
import os, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
for _ in range(600):
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
        sys.exit(0)
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("the rollout server exited; see its log")
        time.sleep(0.5)
sys.exit(f"no /health from {url} after 5 minutes")
PY
echo "rollout server up at $URL (pid $SERVER)"

grpo train --preset tiny-cpu-server --set "rollout.server.urls=[\"$URL\"]" --set "train.steps=$STEPS" \
  --output-dir "$OUT" "$@"
