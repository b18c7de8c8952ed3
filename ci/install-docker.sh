#!/usr/bin/env bash
# The docker tier's image: `ralph-standin:latest`, a Debian bookworm with python3 and nothing else,
# for a compose service that runs the vLLM stand-in (bind-mounted ralph_runner, stdlib only).
# No image registry is reachable here, so the image is built, not pulled: `debootstrap
# --variant=minbase --include=python3` into REPO/.cache/rootfs (about a minute, once), then
# `tar -C rootfs -c . | docker import -` (seconds, once per docker data root).
# It starts no daemon: run ci/dockerd.sh start first. Idempotent; prints one line.
#
# env: IMAGE (ralph-standin:latest), DEBIAN_MIRROR (default: the first http(s) Debian archive in
#      this machine's own apt sources; none there and none given: it says so and gives up, as the
#      repository names no mirror of its own), SUITE (bookworm), APT_SOURCES (the apt source
#      files read for that mirror, space-separated: /etc/apt/sources.list and sources.list.d/).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache"
ROOTFS="$CACHE/rootfs"
DONE="$CACHE/rootfs.done"  # written once debootstrap finished: a half-built rootfs is redone
IMAGE="${IMAGE:-ralph-standin:latest}"
SUITE="${SUITE:-bookworm}"
LOG="$CACHE/install-docker.log"

say() { echo "install-docker: $*"; }
UNAVAILABLE="$CACHE/docker.unavailable" # its statement that it could not (ci/run-tests.sh)
give_up() {
  say "$*; the docker tests will skip"
  mkdir -p "$CACHE" && say "$*" >"$UNAVAILABLE"
  exit 1
}
rm -f "$UNAVAILABLE"

apt_mirror() {  # the Debian archive apt uses here (deb822 .sources or one-line .list files)
  local apt=/etc/apt/sources.list files
  # shellcheck disable=SC2206  # split and globbed on purpose: APT_SOURCES is a list of globs
  files=(${APT_SOURCES:-$apt $apt.d/*.sources $apt.d/*.list})
  grep -hoE 'https?://[^ ]+/debian/?( |$)' "${files[@]}" 2>/dev/null | tr -d ' ' | sed 's:/$::' |
    head -n 1 || true
}

command -v docker >/dev/null || give_up "no docker client"
timeout 10 docker info >/dev/null 2>&1 || give_up "no docker daemon answers (run ci/dockerd.sh start)"
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  say "$IMAGE already there"
  exit 0
fi

mkdir -p "$CACHE"
if [[ ! -f "$DONE" || ! -x "$ROOTFS/usr/bin/python3" ]]; then
  command -v debootstrap >/dev/null || give_up "no debootstrap (Debian: apt-get install debootstrap)"
  [[ "$(id -u)" == 0 ]] || give_up "debootstrap needs root"
  mirror="${DEBIAN_MIRROR:-$(apt_mirror)}"
  [[ -n "$mirror" ]] || give_up "no Debian mirror in this machine's apt sources (set DEBIAN_MIRROR)"
  rm -rf "$ROOTFS" "$DONE"
  if ! debootstrap --variant=minbase --include=python3 "$SUITE" "$ROOTFS" "$mirror" >"$LOG" 2>&1; then
    rm -rf "$ROOTFS"
    give_up "debootstrap $SUITE from $mirror failed ($(tail -n 1 "$LOG"); log: $LOG)"
  fi
  # apt's package cache and lists are a third of the tree and never used in the container.
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  touch "$DONE"
  built="debootstrap $SUITE from $mirror, "
fi
tar -C "$ROOTFS" -c . | docker import --change 'CMD ["python3"]' - "$IMAGE" >/dev/null ||
  give_up "docker import of $ROOTFS failed"
say "built $IMAGE (${built:-}docker import of $ROOTFS, $(du -sh "$ROOTFS" | cut -f1))"
