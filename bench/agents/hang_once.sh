#!/usr/bin/env bash
# The first call: 1 s in, the server hangs (accepts, never answers); the agent then waits on its
# LLM call as opencode does, until something kills it. Later calls: the instant agent.
# env: BENCH_STATE (a scratch directory), BENCH_ROOT_URL (http://127.0.0.1:PORT), BENCH_HANG_AFTER (1)
set -euo pipefail
flag="$BENCH_STATE/hung-once"
if [[ -e "$flag" ]]; then
  exec "$(dirname "$0")/instant.sh"
fi
touch "$flag"
sleep "${BENCH_HANG_AFTER:-1}"
curl -sS --max-time 5 -X POST -H 'Content-Type: application/json' -d '{"mode": "hang"}' \
  "$BENCH_ROOT_URL/admin/fail" >/dev/null
echo "$EPOCHREALTIME" >"$BENCH_STATE/hang-at"
exec curl -sS --max-time 3600 -H 'Content-Type: application/json' \
  -d '{"model": "stand-in", "messages": [{"role": "user", "content": "next item"}]}' \
  "$BENCH_ROOT_URL/v1/chat/completions"
