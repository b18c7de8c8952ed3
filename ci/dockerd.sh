#!/usr/bin/env bash
# A docker daemon for the docker test tier and `.ci/run`: start it, or stop it and its containers.
#
# usage: ci/dockerd.sh start|stop|status
#
# start: a daemon that already answers `docker info` is used as it is (and never stopped by this
#        script). Otherwise it starts Debian's dockerd without touching the host's network
#        (--iptables=false --ip-masq=false --bridge=none: the tier's containers use
#        network_mode: host), its data under DOCKER_DATA_ROOT, and waits until `docker info`
#        answers (DOCKERD_START_TIMEOUT s, default 60). Exit 1, with one line and the end of its
#        log, when it cannot start (no privileges, no kernel support).
# stop:  only a daemon this script started (its pidfile): first every container it runs (they
#        outlive a killed dockerd), then dockerd with SIGTERM, SIGKILL after 20 s.
#
# env: DOCKER_DATA_ROOT (REPO/.cache/docker), DOCKERD_STATE (REPO/.cache/dockerd: pidfile, log).
# `.ci/run`:  ci/dockerd.sh start || true;  trap 'ci/dockerd.sh stop' EXIT
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_ROOT="${DOCKER_DATA_ROOT:-$REPO/.cache/docker}"
STATE="${DOCKERD_STATE:-$REPO/.cache/dockerd}"
PID_FILE="$STATE/dockerd.pid"
LOG="$STATE/dockerd.log"
START_TIMEOUT="${DOCKERD_START_TIMEOUT:-60}"

answers() { timeout 10 docker info >/dev/null 2>&1; }

alive() {  # PID: a live dockerd, not a recycled pid
  grep -qaF dockerd "/proc/$1/cmdline" 2>/dev/null
}

our_pid() { cat "$PID_FILE" 2>/dev/null || true; }

daemon_pid() {  # the dockerd serving our data root, however it was started (for a moment after
  # setsid forks, its child is still `setsid dockerd ...`, before it execs dockerd)
  pgrep -f -- "^(setsid )?dockerd .*--data-root $DATA_ROOT( |$)" | head -n 1 || true
}

poll() {  # SECONDS COMMAND...: until COMMAND succeeds; 1 when the time is up
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

gone() { ! alive "$1"; }

fail() {  # MESSAGE
  echo "dockerd: $1" >&2
  [[ -f "$LOG" ]] && tail -n 5 "$LOG" | sed 's/^/    /' >&2
  exit 1
}

start() {
  if answers; then
    echo "dockerd: a daemon already answers (docker info): using it"
    return 0
  fi
  command -v dockerd >/dev/null || fail "no dockerd on PATH (Debian: apt-get install docker.io)"
  [[ "$(id -u)" == 0 ]] || fail "needs root to start dockerd (uid $(id -u))"
  mkdir -p "$DATA_ROOT" "$STATE"
  local pid
  pid="$(our_pid)"
  if [[ -n "$pid" ]] && alive "$pid"; then
    poll "$START_TIMEOUT" answers || fail "dockerd pid $pid is up but docker info does not answer"
    echo "dockerd: already started (pid $pid)"
    return 0
  fi
  # setsid: its own session, so it lives on after this script and a test's process-tree kill.
  # setsid forks when it is started as a group leader (a background job of a script run in the
  # background, as .ci/run does): then $! is gone at once, so the daemon is found by its data root.
  setsid dockerd --iptables=false --ip-masq=false --bridge=none \
    --data-root "$DATA_ROOT" --pidfile "$PID_FILE.dockerd" \
    </dev/null >>"$LOG" 2>&1 &
  local launcher=$! missing=0
  until answers; do
    # Gone only when neither the launcher nor a daemon on our data root shows, twice 0.2 s
    # apart: the launcher is asked first (a daemon it forked exists before it exits), and for
    # the moment of its execve a process has no command line to match. A daemon that started
    # well was reported as exited twice in CI rehearsals, by the one-look check before this.
    if ! alive "$launcher" && [[ -z "$(daemon_pid)" ]]; then
      ((++missing < 2)) || fail "dockerd exited during start-up (log: $LOG)"
    else
      missing=0
    fi
    pid="$(daemon_pid)"
    if ((SECONDS >= START_TIMEOUT)); then
      [[ -n "$pid" ]] && echo "$pid" >"$PID_FILE"
      stop
      fail "docker info did not answer within ${START_TIMEOUT}s (log: $LOG)"
    fi
    sleep 0.2
  done
  pid="$(daemon_pid)"
  echo "$pid" >"$PID_FILE"
  echo "dockerd: started (pid $pid, data root $DATA_ROOT, log $LOG)"
}

stop() {
  local pid
  pid="$(our_pid)"
  if [[ -z "$pid" ]] || ! alive "$pid"; then
    rm -f "$PID_FILE"
    echo "dockerd: none started by this script"
    return 0
  fi
  local running
  running="$(timeout 10 docker ps -q 2>/dev/null || true)"
  if [[ -n "$running" ]]; then
    # shellcheck disable=SC2086  # one id per word
    timeout 60 docker stop -t 5 $running >/dev/null 2>&1 || echo "dockerd: could not stop all containers" >&2
  fi
  kill -TERM "$pid" 2>/dev/null || true
  if ! poll 20 gone "$pid"; then
    echo "dockerd: pid $pid ignored SIGTERM for 20s: SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
    poll 5 gone "$pid" || fail "pid $pid survived SIGKILL"
  fi
  rm -f "$PID_FILE"
  echo "dockerd: stopped (pid $pid)"
}

status() {
  if answers; then
    echo "dockerd: answers (started here: $(our_pid || true))"
  else
    echo "dockerd: not answering"
    return 1
  fi
}

case "${1:-}" in
  start | stop | status) "$1" ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
