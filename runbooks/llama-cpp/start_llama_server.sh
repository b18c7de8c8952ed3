#!/usr/bin/env bash
# llama.cpp's `llama-server` as a plain process: start it, stop it, kill it, show it.
# The start script of runbooks/llama-cpp.yaml, and usable by hand.
#
# usage: start_llama_server.sh [start|stop|kill|restart|status]        (default: start)
#   start    a healthy server (a 1-token generation answers, or its counters move while it
#            waits: busy) is left alone; one still loading its model (/health answers 503,
#            ours or not) is waited for; one that is up but not healthy (hung, stopped) is
#            killed; then a new server starts in its own session and is polled until healthy.
#   stop     SIGTERM (and SIGCONT, so a stopped server can obey), SIGKILL after STOP_TIMEOUT;
#            returns when no process of its group is left.
#   kill     SIGKILL at once: a generation stalled inside the engine never returns to the loop
#            that reads the SIGTERM flag, and only SIGKILL ends it (llama.cpp #27388).
#   restart  stop, then start.
#   status   the group's processes (state T: stopped) and the health verdict; exit 0 healthy,
#            1 up but not healthy (loading counts: not serving yet), 3 not running.
#
# env:  LLAMA_SERVER           the llama-server binary (default: llama-server on PATH)
#       LLAMA_MODEL            the GGUF file it serves (start)
#       LLAMA_ALIAS            the model name clients ask for (--alias; default: the file's)
#       LLAMA_HOST, LLAMA_PORT where it listens (default: 127.0.0.1, 8080)
#       LLAMA_DIR              its pid file (llama-server.pid) and log (llama-server.log; the
#                              server before it logged to llama-server.log.1)
#                              (default: ~/.local/state/llama-server-PORT)
#       LLAMA_ARGS             more llama-server arguments, split on whitespace
#                              (e.g. "--ctx-size 32768 --parallel 1")
#       LLAMA_PYTHON           a python 3 for the health verdict (default: python3)
#       and in seconds: START_TIMEOUT (600, whole), STOP_TIMEOUT (10, whole),
#       HEALTH_TIMEOUT (10, for the 1-token generation)
# `--metrics` is always given: the runbook's progress probe reads /metrics (llama-server
# answers it only with the flag).
#
# A start that fails shows the line of the log that explains it (the first error line of this
# start), then the log's last lines.
set -euo pipefail

ACTION="${1:-start}"
LLAMA_SERVER="${LLAMA_SERVER:-llama-server}"
LLAMA_HOST="${LLAMA_HOST:-127.0.0.1}"
LLAMA_PORT="${LLAMA_PORT:-8080}"
LLAMA_DIR="${LLAMA_DIR:-$HOME/.local/state/llama-server-$LLAMA_PORT}"
LLAMA_PYTHON="${LLAMA_PYTHON:-python3}"
START_TIMEOUT="${START_TIMEOUT:-600}"
STOP_TIMEOUT="${STOP_TIMEOUT:-10}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-10}"
PID_FILE="$LLAMA_DIR/llama-server.pid"
LOG="$LLAMA_DIR/llama-server.log"
BASE="http://$LLAMA_HOST:$LLAMA_PORT"
NAME="$(basename "$LLAMA_SERVER")"

say() { echo "[llama-server] $*"; }
now_us() { echo "${EPOCHREALTIME/./}"; }

# One health verdict on stdout; exit 0 healthy (answers, or busy: its counters move while our
# request waits for the slot), 1 not, 2 loading (/health 503: the model is not in memory yet).
# /health alone says nothing of the engine: it answers 200 while a generation is stalled.
verdict() {
  "$LLAMA_PYTHON" - "$BASE" "${LLAMA_ALIAS:-}" "$HEALTH_TIMEOUT" <<'PY'
import json, re, sys, urllib.error, urllib.request as web

base, model, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
COUNTER = re.compile(r"^llamacpp:(tokens_predicted|prompt_tokens|n_decode)_total\s+(\S+)", re.M)

def timed_out(error):
    return isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)

def steps():
    """The engine's counters summed; None when /metrics cannot say (no --metrics, late)."""
    try:
        with web.urlopen(f"{base}/metrics", timeout=timeout) as answer:
            return sum(float(match[2]) for match in COUNTER.finditer(answer.read().decode()))
    except (OSError, ValueError):
        return None

try:
    web.urlopen(f"{base}/health", timeout=timeout).read()
except urllib.error.HTTPError as error:
    if error.code == 503:
        sys.exit(print(f"loading: /health answered 503 ({error.read()[:80].decode(errors='replace')})") or 2)
    sys.exit(print(f"unhealthy: /health answered HTTP {error.code}") or 1)
except OSError as error:
    sys.exit(print(f"{'hung' if timed_out(error) else 'down'}: /health: {error}") or 1)
before = steps()
body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
if model:
    body["model"] = model
request = web.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                      {"Content-Type": "application/json"})
try:
    web.urlopen(request, timeout=timeout).read()
    sys.exit(print("healthy: a 1-token generation answered") or 0)
except urllib.error.HTTPError as error:
    sys.exit(print(f"unhealthy: generation answered HTTP {error.code}") or 1)
except OSError as error:
    if not timed_out(error):
        sys.exit(print(f"down: {error}") or 1)
after = steps()
if before is not None and after is not None and after > before:
    sys.exit(print(f"busy: +{after - before:g} engine steps and tokens while a 1-token request waited") or 0)
sys.exit(print(f"hung: no token within {timeout:g} s") or 1)
PY
}

# The live processes of the group the pid file names, one "pid stat elapsed rss command" line
# each (llama-server is one process; a helper it started would share the group).
members() {
  local pgid
  pgid="$(cat "$PID_FILE" 2>/dev/null)" || return 0
  [[ $pgid =~ ^[0-9]+$ ]] || return 0
  ps -e -o pid=,pgid=,stat=,etime=,rss=,args= |
    awk -v g="$pgid" '$2 == g && $3 !~ /^Z/ { $2 = ""; print }'
}

running() { # PID: alive and not a zombie (the server is our child until we exit)
  local state
  state="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ $state != Z* ]]
}

ours() { # is the group still llama-server's? (a pid file outliving a reboot names someone else)
  members | grep -qF -- "$NAME"
}

wait_empty() { # SECONDS: until the group has no live process
  local deadline=$(($(now_us) + $1 * 1000000))
  while [[ -n "$(members)" ]]; do
    (($(now_us) < deadline)) || return 1
    sleep 0.1
  done
}

signal_group() { # SIGNAL WHY: signal the group, wait for it to end (SIGKILL after STOP_TIMEOUT)
  local pgid
  pgid="$(cat "$PID_FILE" 2>/dev/null || true)"
  if [[ -z $pgid ]] || ! ours; then
    say "not running"
    rm -f "$PID_FILE"
    return 0
  fi
  say "$2 process group $pgid (pids $(members | awk '{printf "%s%s", sep, $1; sep=" "}'))"
  kill "-$1" -- "-$pgid" 2>/dev/null || true
  kill -CONT -- "-$pgid" 2>/dev/null || true # a SIGSTOPped server handles its TERM only now
  if ! wait_empty "$STOP_TIMEOUT"; then
    say "group $pgid still up after ${STOP_TIMEOUT}s: SIGKILL"
    kill -KILL -- "-$pgid" 2>/dev/null || true
    wait_empty 10 || { say "group $pgid survived SIGKILL" >&2; exit 1; }
  fi
  rm -f "$PID_FILE"
  say "stopped"
}

# The line of the log (this start's: launch rotates it) that explains a failed start: the first
# line that says error or failed ("llama_model_load: error loading model: ...", "couldn't bind
# HTTP server socket"...). Nothing when the log holds none.
cause_in_log() {
  grep -a -m 1 -i -E 'error|failed|couldn.t|exiting' "$LOG" 2>/dev/null || true
}

fail_with_log() {
  local cause
  cause="$(cause_in_log)"
  if [[ -n $cause ]]; then
    say "$1; the line of $LOG that explains it:" >&2
    printf '%s\n' "$cause" >&2
  fi
  say "$1; last lines of $LOG:" >&2
  tail -n 15 "$LOG" | sed 's/^/    /' >&2
  exit 1
}

launch() {
  : "${LLAMA_MODEL:?set LLAMA_MODEL: the GGUF file to serve}"
  local args=()
  read -r -a args <<<"${LLAMA_ARGS:-}"
  [[ -n ${LLAMA_ALIAS:-} ]] && args+=(--alias "$LLAMA_ALIAS")
  mkdir -p "$LLAMA_DIR"
  [[ -f $LOG ]] && mv -f "$LOG" "$LOG.1" # the death record reads the log of the server that died
  say "starting llama-server on $BASE, model $LLAMA_MODEL (log: $LOG)"
  echo "[llama-server] $(date -u +%FT%TZ) start_llama_server.sh: ${args[*]}" >"$LOG"
  # setsid: its own session and process group, so the loop's kill of a step's tree leaves it
  # running, and `stop` finds it by its group. No job control in a script, so the child is no
  # group leader and setsid execs in place: $! is the server, the group's id.
  setsid "$LLAMA_SERVER" --host "$LLAMA_HOST" --port "$LLAMA_PORT" --model "$LLAMA_MODEL" \
    --metrics "${args[@]}" </dev/null >>"$LOG" 2>&1 &
  echo "$!" >"$PID_FILE"
}

poll_healthy() { # [PID]: until healthy; a PID of ours that exits fails the start
  local pid=${1:-} deadline state code told=""
  deadline=$(($(now_us) + START_TIMEOUT * 1000000))
  while true; do
    code=0
    state="$(verdict)" || code=$?
    ((code == 0)) && break
    if ((code == 2)) && [[ -z $told ]]; then
      say "$state: waiting for the model to load"
      told=1
    fi
    if [[ -n $pid ]] && ! running "$pid"; then
      signal_group KILL stopping >/dev/null
      fail_with_log "llama-server exited during start-up"
    fi
    if (($(now_us) >= deadline)); then
      [[ -n $pid ]] && signal_group KILL killing
      fail_with_log "not healthy after ${START_TIMEOUT}s ($state)"
    fi
    sleep 0.2
  done
  say "healthy: ${pid:+pid $pid, }$BASE/v1 ($state)"
}

start() {
  local state code=0
  state="$(verdict)" || code=$?
  if ((code == 0)); then
    say "already running: $state"
    return 0
  fi
  if ((code == 2)); then # loading: ours or someone else's, it holds the port
    say "found $state"
    if ours; then poll_healthy "$(cat "$PID_FILE")"; else poll_healthy; fi
    return 0
  fi
  if ours; then
    say "up but not healthy ($state)"
    signal_group KILL killing # hung or stopped: only SIGKILL is sure to end it
  fi
  launch
  poll_healthy "$(cat "$PID_FILE")"
}

status() {
  local state code=0
  if ! ours; then
    say "not running (no process of ${PID_FILE})"
    return 3
  fi
  say "process group $(cat "$PID_FILE") (pid stat elapsed rss-KiB command):"
  members | sed 's/^/    /'
  state="$(verdict)" || code=1
  say "$state"
  return "$code"
}

case "$ACTION" in
  start) start ;;
  stop) signal_group TERM stopping ;;
  kill) signal_group KILL killing ;;
  restart) signal_group TERM stopping && start ;;
  status) status ;;
  *) echo "usage: $0 [start|stop|kill|restart|status]" >&2 && exit 2 ;;
esac
