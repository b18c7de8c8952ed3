#!/usr/bin/env bash
# llama.cpp's `llama-server` as a plain process: start it, stop it, kill it, show it.
# The start script of runbooks/llama-cpp.yaml, and usable by hand.
#
# usage: start_llama_server.sh [start|stop|kill|restart|status]        (default: start)
#   start    a healthy server (a 1-token generation answers, or its counters move while it
#            waits: busy) is left alone; one still loading its model (/health answers 503,
#            ours or not) is waited for; one that is up but not healthy (hung, stopped) is
#            killed; then a new server starts in its own session and is polled until healthy.
#            A healthy server must hold the port with a socket of our user (or root), and one
#            started here with its own group's: another user's fails the start, exit 1
#            (after a crash they may bind the port first; docs/security.md).
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

# Who listens on TCP port $1: one "uid inode" line per listening socket there, at any address,
# from the kernel's tables (/proc/net/tcp and tcp6: state 0A, the port in hex), which any user
# may read; neither iproute2's `ss` nor python is needed.
listeners() {
  local hex table tables=()
  printf -v hex ':%04X' "$1"
  for table in /proc/net/tcp /proc/net/tcp6; do
    [[ -r $table ]] && tables+=("$table")
  done
  ((${#tables[@]} > 0)) || return 0
  awk -v port="$hex" '$4 == "0A" && substr($2, length($2) - 4) == port { print $8, $10 }' \
    "${tables[@]}"
}

# The inodes of the sockets that the pid file's group holds (/proc/PID/fd/N -> socket:[INODE]).
group_sockets() {
  local pid
  for pid in $(members | awk '{ print $1 }'); do
    find "/proc/$pid/fd" -maxdepth 1 -lname 'socket:*' -printf '%l\n' 2>/dev/null || true
  done | tr -dc '0-9\n'
}

# [PID]: is the server that answers ours? Another local user may bind the port first after a
# crash and answer as a healthy server: every prompt would go to them, and their answers drive
# the agent (docs/security.md). So every socket listening on the port must be our user's (or
# root's: it can act as us anyway) and, given the PID of the server this script started, its
# group's. Says why not, and returns 1.
check_owner() {
  local me found theirs ours inode strangers=""
  me="$(id -u)"
  if [[ ! -r /proc/net/tcp ]]; then
    say "who listens on port $LLAMA_PORT cannot be told here (no /proc/net/tcp): not checked" >&2
    return 0
  fi
  found="$(listeners "$LLAMA_PORT")"
  theirs="$(awk -v me="$me" '$1 != me && $1 != 0 { print $1 }' <<<"$found" | sort -un |
    paste -sd, -)"
  if [[ -n $theirs ]]; then
    say "port $LLAMA_PORT is held by uid $theirs, not by us (uid $me): another user's" \
      "server answers there and would get every prompt; not trusted" >&2
    return 1
  fi
  [[ -n ${1:-} ]] || return 0
  ours=" $(group_sockets | tr '\n' ' ') "
  while read -r _ inode; do
    [[ -z $inode || $ours == *" $inode "* ]] || strangers+=" $inode"
  done <<<"$found"
  if [[ -z $found || -n $strangers ]]; then
    say "port $LLAMA_PORT is not held by the server this script started (pid $1)" >&2
    return 1
  fi
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
  # said here, by name: llama-server itself says only "exiting due to model loading error"
  [[ -f $LLAMA_MODEL ]] || { say "no model file at $LLAMA_MODEL (LLAMA_MODEL, the runbook's model_path)" >&2; exit 1; }
  command -v "$LLAMA_SERVER" >/dev/null ||
    { say "$LLAMA_SERVER not found (LLAMA_SERVER, the runbook's llama_server): install llama.cpp or give its path" >&2; exit 1; }
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
  if ! check_owner "$pid"; then
    [[ -n $pid ]] || exit 1
    signal_group KILL killing >/dev/null
    fail_with_log "the server on $BASE is not the one this script started"
  fi
  say "healthy: ${pid:+pid $pid, }$BASE/v1 ($state)"
}

start() {
  local state code=0
  state="$(verdict)" || code=$?
  if ((code == 0)); then
    check_owner || exit 1
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
