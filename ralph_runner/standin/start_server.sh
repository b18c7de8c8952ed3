#!/usr/bin/env bash
# Idempotent start of the vLLM stand-in, in the spirit of the seed's start_vllm.sh: a healthy server
# is left alone; a hung or dead one is cleared away; a new one is started in its own session (so it
# outlives this script and whatever kills this script's process tree) and polled until healthy.
#
# "Healthy" is not /health alone: a hung engine answers /health (and /v1/models, /metrics) with 200
# while no generation ever ends. So the check also asks for one token within HEALTH_TIMEOUT; when
# that times out, the token counters in /metrics tell a busy engine (they moved: left alone) from
# a hung one (they did not: its whole process group is stopped and a new server started).
#
# usage: start_server.sh [PORT [STATE_DIR]]          (or the env variables PORT and STATE_DIR)
# env:   PYTHON (python3), MODEL (stand-in), LOG (STATE_DIR/server.log), and in seconds:
#        START_TIMEOUT (20, whole), STOP_TIMEOUT (5, whole), HEALTH_TIMEOUT (2, per health check)
#        passed to the server when set: TOKENS_PER_SECOND, MAX_NUM_SEQS, EXECUTE_MODEL_TIMEOUT,
#        SHUTDOWN_DELAY, SCRIPT, BATCH_CURVE, FAULTS (a JSON object: faults set at every start,
#        e.g. '{"die_on_prompt_chars": 2000}'; see `python -m ralph_runner.standin.server --help`),
#        and the rot (standin/rot.py): DECODE_HALFLIFE, DECODE_FLOOR, LEAK_KB_PER_REQUEST,
#        MEMORY_LIMIT_MB, PREEMPTIONS_PER_REQUEST
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
ROOT_URL="http://127.0.0.1:$PORT"
PID_FILE="$STATE_DIR/server.pid"
LOG="${LOG:-$STATE_DIR/server.log}"

# "$PYTHON -m ralph_runner..." must work from a source checkout as well as from an install.
PACKAGE_PARENT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$PACKAGE_PARENT${PYTHONPATH:+:$PYTHONPATH}"

now_us() { echo "${EPOCHREALTIME/./}"; }

# One check, printed as one word: healthy | busy | hung | down | status N. Exit 0 for healthy/busy.
CHECK='
import json, sys, time, urllib.error, urllib.request as u
root, model, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
def tokens():
    text = u.urlopen(root + "/metrics", timeout=timeout).read().decode()
    names = ("vllm:generation_tokens_total{", "vllm:prompt_tokens_total{")
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(names))
try:
    u.urlopen(root + "/health", timeout=timeout)
    body = json.dumps({"model": model, "prompt": "ping", "max_tokens": 1}).encode()
    ask = u.Request(root + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        u.urlopen(ask, timeout=timeout).read()
    except TimeoutError:  # queued behind a busy engine, or a hung one: do the counters move?
        before = tokens()
        time.sleep(1)
        moved = tokens() > before
        print("busy" if moved else "hung")
        sys.exit(0 if moved else 3)
    print("healthy")
except urllib.error.HTTPError as error:
    print(f"status {error.code}")
    sys.exit(1)
except (OSError, ValueError):
    print("down")
    sys.exit(1)
'
check() {  # curl is not everywhere; the python that runs the server is
  "$PYTHON" -c "$CHECK" "$ROOT_URL" "$MODEL" "$HEALTH_TIMEOUT" 2>/dev/null || true
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

stop_server() {  # PID: TERM, then KILL, its process group if it leads one; then make sure
  local target="$1"
  [[ "$(ps -o pgid= -p "$1" 2>/dev/null | tr -d ' ')" == "$1" ]] && target="-$1"
  kill -TERM -- "$target" 2>/dev/null || true
  wait_gone "$1" "$STOP_TIMEOUT" && return 0
  echo "[start] pid $1 ignored SIGTERM for ${STOP_TIMEOUT}s: SIGKILL"
  kill -KILL -- "$target" 2>/dev/null || true
  wait_gone "$1" 5 || { echo "[start] pid $1 survived SIGKILL" >&2; exit 1; }
}

fail_with_log() {  # MESSAGE
  echo "[start] $1; last lines of $LOG:" >&2
  tail -n 8 "$LOG" | sed 's/^/    /' >&2
  exit 1
}

mkdir -p "$STATE_DIR"
state="$(check)"
if [[ "$state" == healthy || "$state" == busy ]]; then
  echo "[start] already running ($state)"
  exit 0
fi

old_pid="$(cat "$PID_FILE" 2>/dev/null || true)"
if [[ -n "$old_pid" ]] && is_server "$old_pid"; then
  echo "[start] server pid $old_pid is up but not healthy ($state): stopping its process group"
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
server_args=(--port "$PORT" --state-dir "$STATE_DIR" --model "$MODEL" --log "$LOG")
[[ -n "${TOKENS_PER_SECOND:-}" ]] && server_args+=(--tokens-per-second "$TOKENS_PER_SECOND")
[[ -n "${MAX_NUM_SEQS:-}" ]] && server_args+=(--max-num-seqs "$MAX_NUM_SEQS")
[[ -n "${EXECUTE_MODEL_TIMEOUT:-}" ]] && server_args+=(--execute-model-timeout "$EXECUTE_MODEL_TIMEOUT")
[[ -n "${SHUTDOWN_DELAY:-}" ]] && server_args+=(--shutdown-delay "$SHUTDOWN_DELAY")
[[ -n "${SCRIPT:-}" ]] && server_args+=(--script "$SCRIPT")
[[ -n "${BATCH_CURVE:-}" ]] && server_args+=(--batch-curve "$BATCH_CURVE")
[[ -n "${FAULTS:-}" ]] && server_args+=(--faults "$FAULTS")  # faults at every start (JSON)
[[ -n "${DECODE_HALFLIFE:-}" ]] && server_args+=(--decode-halflife "$DECODE_HALFLIFE")
[[ -n "${DECODE_FLOOR:-}" ]] && server_args+=(--decode-floor "$DECODE_FLOOR")
[[ -n "${LEAK_KB_PER_REQUEST:-}" ]] && server_args+=(--leak-kb-per-request "$LEAK_KB_PER_REQUEST")
[[ -n "${MEMORY_LIMIT_MB:-}" ]] && server_args+=(--memory-limit-mb "$MEMORY_LIMIT_MB")
[[ -n "${PREEMPTIONS_PER_REQUEST:-}" ]] && server_args+=(--preemptions-per-request "$PREEMPTIONS_PER_REQUEST")
setsid "$PYTHON" -m ralph_runner.standin.server "${server_args[@]}" </dev/null >>"$LOG" 2>&1 &
pid=$!

deadline=$(($(now_us) + START_TIMEOUT * 1000000))
until [[ "$(check)" == healthy ]]; do
  is_server "$pid" || fail_with_log "server exited during startup"
  if (($(now_us) >= deadline)); then
    stop_server "$pid"
    fail_with_log "not healthy after ${START_TIMEOUT}s"
  fi
  sleep 0.1
done
echo "[start] healthy: pid $pid, http://127.0.0.1:$PORT/v1"
