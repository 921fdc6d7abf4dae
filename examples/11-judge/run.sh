#!/usr/bin/env bash
# A generative judge served by `grpo serve-rollout` (the built-in tiny model, bearer token on) scores the tiny
# policy's completions for a few steps. Extra arguments go to `grpo train`. OUT: where the judge server's log and
# the run's config (config.yaml with the server's URL) go (default runs/judge).
set -euo pipefail
cd "$(dirname "$0")"
OUT="${OUT:-runs/judge}"
mkdir -p "$OUT"
export GRPO_JUDGE_TOKEN="${GRPO_JUDGE_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}"

grpo serve-rollout --engine hf --model builtin:tiny --port 0 --token-env GRPO_JUDGE_TOKEN > "$OUT/judge.log" 2>&1 &
JUDGE=$!
trap 'kill "$JUDGE" 2>/dev/null || true; wait "$JUDGE" 2>/dev/null || true' EXIT
URL=""
for _ in $(seq 600); do  # --port 0: the server prints the URL it listens on once it is up
  URL=$(grep -o 'listening on http://127\.0\.0\.1:[0-9]*' "$OUT/judge.log" | head -n 1 | cut -d' ' -f3 || true)
  [ -n "$URL" ] && break
  kill -0 "$JUDGE" 2>/dev/null || { cat "$OUT/judge.log" >&2; echo "the judge server exited" >&2; exit 1; }
  sleep 0.5
done
[ -n "$URL" ] || { echo "the judge server did not start within 5 minutes" >&2; exit 1; }
echo "judge server up at $URL"

sed "s#http://127.0.0.1:8200#$URL#" config.yaml > "$OUT/config.yaml"
grpo train --config "$OUT/config.yaml" "$@"
