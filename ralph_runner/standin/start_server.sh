#!/usr/bin/env bash
# Idempotent start of the vLLM stand-in, in the spirit of the seed's start_vllm.sh: a healthy server
# is left alone; a hung or dead one is cleared away; a new one is started in its own session (so it
# outlives this script and whatever kills this script's process tree) and polled until healthy.
#
# usage: start_server.sh [PORT [STATE_DIR]]          (or the env variables PORT and STATE_DIR)
# env:   PYTHON (python3), MODEL (stand-in), LOG (STATE_DIR/server.log), and in seconds:
#        START_TIMEOUT (20, whole), STOP_TIMEOUT (5, whole), HEALTH_TIMEOUT (2, per health check)
# files in STATE_DIR: server.pid, server.log, starts (servers launched so far), and fail_starts:
#        write N there and the next N starts fail like a start while another job holds the GPU.
set -euo pipefail

PORT="${1:-${PORT:?give PORT as argument 1 or in the environment}}"
STATE_DIR="${2:-${STATE_DIR:?give STATE_DIR as argument 2 or in the environment}}"
PYTHON="${PYTHON:-python3}"
MODEL="${MODEL:-stand-in}"
START_TIMEOUT="${START_TIMEOUT:-20}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-2}"
STOP_TIMEOUT="${STOP_TIMEOUT:-5}"
HEALTH_URL="http://127.0.0.1:$PORT/health"
PID_FILE="$STATE_DIR/server.pid"
LOG="${LOG:-$STATE_DIR/server.log}"

# "$PYTHON -m ralph_runner..." must work from a source checkout as well as from an install.
PACKAGE_PARENT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$PACKAGE_PARENT${PYTHONPATH:+:$PYTHONPATH}"

now_us() { echo "${EPOCHREALTIME/./}"; }

healthy() {  # curl is not everywhere; the python that runs the server is
  "$PYTHON" -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=float(sys.argv[2]))' \
    "$HEALTH_URL" "$HEALTH_TIMEOUT" >/dev/null 2>&1
}

is_server() {  # PID: is it alive and our server, not a recycled pid or a zombie?
  grep -qaF 'ralph_runner.standin.server' "/proc/$1/cmdline" 2>/dev/null
}

wait_gone() {  # PID SECONDS
  local deadline=$(($(now_us) + $2 * 1000000))
  while is_server "$1"; do
    (($(now_us) < deadline)) || return 1
    sleep 0.1
  done
}

stop_server() {  # PID: TERM, then KILL, then make sure it is gone
  kill -TERM "$1" 2>/dev/null || true
  wait_gone "$1" "$STOP_TIMEOUT" && return 0
  echo "[start] pid $1 ignored SIGTERM for ${STOP_TIMEOUT}s: SIGKILL"
  kill -KILL "$1" 2>/dev/null || true
  wait_gone "$1" 5 || { echo "[start] pid $1 survived SIGKILL" >&2; exit 1; }
}

fail_with_log() {  # MESSAGE
  echo "[start] $1; last lines of $LOG:" >&2
  tail -n 8 "$LOG" | sed 's/^/    /' >&2
  exit 1
}

mkdir -p "$STATE_DIR"
if healthy; then
  echo "[start] already running"
  exit 0
fi

old_pid="$(cat "$PID_FILE" 2>/dev/null || true)"
if [[ -n "$old_pid" ]] && is_server "$old_pid"; then
  echo "[start] server pid $old_pid is up but not healthy: stopping it"
  stop_server "$old_pid"
fi
rm -f "$PID_FILE"

fail_starts="$(cat "$STATE_DIR/fail_starts" 2>/dev/null || echo 0)"
if ((fail_starts > 0)); then
  echo $((fail_starts - 1)) >"$STATE_DIR/fail_starts"
  echo "[start] CUDA out of memory: another job holds 80 GiB" >&2
  exit 1
fi

starts="$(cat "$STATE_DIR/starts" 2>/dev/null || echo 0)"
echo $((starts + 1)) >"$STATE_DIR/starts"
echo "[start] starting the vLLM stand-in on port $PORT (log: $LOG)"
# setsid: its own session, so killing this script's session or tree leaves the server running.
# No job control here, so the child is not a group leader and setsid execs in place: $! is the server.
setsid "$PYTHON" -m ralph_runner.standin.server \
  --port "$PORT" --state-dir "$STATE_DIR" --model "$MODEL" --log "$LOG" \
  </dev/null >>"$LOG" 2>&1 &
pid=$!

deadline=$(($(now_us) + START_TIMEOUT * 1000000))
until healthy; do
  is_server "$pid" || fail_with_log "server exited during startup"
  if (($(now_us) >= deadline)); then
    stop_server "$pid"
    fail_with_log "not healthy after ${START_TIMEOUT}s"
  fi
  sleep 0.1
done
echo "[start] healthy: pid $pid, http://127.0.0.1:$PORT/v1"
