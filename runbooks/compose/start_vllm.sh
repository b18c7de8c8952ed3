#!/usr/bin/env bash
# Idempotent start of the vLLM compose service, as the seed's start_vllm.sh: healthy -> "already
# running", exit 0; otherwise `docker compose up -d` (it starts an `Exited (0)` container again,
# or creates it) and poll the health URL until it answers.
#
# It never stops a container: a hung engine still answers /health, so this script would call it
# "already running". runbooks/vllm.yaml stops the container first when the death was a hang
# (`when: death.hung`), then runs this script.
#
# env: CONTAINER (vllm-spark-head), PORT (8000), HEALTH_URL (http://127.0.0.1:PORT/health),
#      COMPOSE_FILE (docker-compose.yml beside this script), COMPOSE_PROFILES (e.g. head, as the
#      seed's `--profile head`), COMPOSE_PROJECT_NAME: docker compose reads these itself;
#      COMPOSE ("docker compose" when that plugin is there, else docker-compose), and in seconds:
#      START_TIMEOUT (360: the seed's 90 polls x 4 s; vLLM's cold start is ~3 min),
#      POLL_INTERVAL (4), HEALTH_TIMEOUT (3, per check).
# exit: 0 healthy; 1 compose failed, the container exited, or not healthy in time (the end of
#      its log is printed), or another user's server holds PORT (docs/security.md).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export COMPOSE_FILE="${COMPOSE_FILE:-$HERE/docker-compose.yml}"
CONTAINER="${CONTAINER:-vllm-spark-head}"
PORT="${PORT:-8000}"
HEALTH_URL="${HEALTH_URL:-http://127.0.0.1:$PORT/health}"
START_TIMEOUT="${START_TIMEOUT:-360}"
POLL_INTERVAL="${POLL_INTERVAL:-4}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-3}"

healthy() { curl -sf --max-time "$HEALTH_TIMEOUT" "$HEALTH_URL" >/dev/null 2>&1; }

compose() {  # the v2 plugin where there is one, else Debian's docker-compose (v1)
  if [[ -n "${COMPOSE:-}" ]]; then
    # shellcheck disable=SC2086  # COMPOSE is a command line, e.g. "docker compose"
    $COMPOSE "$@"
  elif docker compose version >/dev/null 2>&1; then
    docker compose "$@"
  else
    docker-compose "$@"
  fi
}

# Is the server that answers ours? Another local user may bind PORT first while the container
# is down and answer as a healthy server: every prompt would go to them, and their answers drive
# the agent (docs/security.md). Every socket listening on PORT (the kernel's tables, state 0A,
# the port in hex: no `ss` or python needed) must be our user's or root's: docker's port proxy
# (docker-proxy) listens as root, rootless docker's as us. A port nobody is seen to hold
# (docker's NAT without its proxy) is not refused: a server would have to listen to be reached.
check_owner() {
  local me hex table tables=() theirs
  me="$(id -u)"
  printf -v hex ':%04X' "$PORT"
  for table in /proc/net/tcp /proc/net/tcp6; do
    [[ -r $table ]] && tables+=("$table")
  done
  if ((${#tables[@]} == 0)); then
    echo "[start_vllm] who listens on port $PORT cannot be told here (no /proc/net/tcp)" >&2
    return 0
  fi
  theirs="$(awk -v port="$hex" -v me="$me" '$4 == "0A" && substr($2, length($2) - 4) == port &&
    $8 != me && $8 != 0 { print $8 }' "${tables[@]}" | sort -un | paste -sd, -)"
  if [[ -n $theirs ]]; then
    echo "[start_vllm] port $PORT is held by uid $theirs, not by us (uid $me): another user's" \
      "server answers there and would get every prompt; not trusted" >&2
    return 1
  fi
}

state() { docker inspect --format '{{.State.Status}}' "$CONTAINER" 2>/dev/null || echo missing; }

fail_with_log() {  # MESSAGE
  echo "[start_vllm] $1; last lines of its log:" >&2
  docker logs --tail 15 "$CONTAINER" 2>&1 | sed 's/^/    /' >&2 || true
  exit 1
}

if healthy; then
  check_owner || exit 1
  echo "[start_vllm] vLLM already running ($HEALTH_URL)"
  exit 0
fi

echo "[start_vllm] starting $CONTAINER ($COMPOSE_FILE)"
if ! compose up -d 2>&1 | tail -n 5; then
  echo "[start_vllm] docker compose up -d failed ($COMPOSE_FILE)" >&2
  exit 1
fi

deadline=$((SECONDS + START_TIMEOUT))
until healthy; do
  case "$(state)" in
    running | restarting) ;;
    *) fail_with_log "container $CONTAINER is $(state) during start-up" ;;
  esac
  ((SECONDS < deadline)) || fail_with_log "not healthy after ${START_TIMEOUT}s ($HEALTH_URL)"
  sleep "$POLL_INTERVAL"
done
check_owner || exit 1
echo "[start_vllm] healthy: $CONTAINER, $HEALTH_URL"
