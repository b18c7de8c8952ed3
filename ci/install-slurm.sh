#!/usr/bin/env bash
# A one-node Slurm for the slurm test tier and bench/slurm_fleet.py: install, start, stop.
#
# usage: ci/install-slurm.sh start|stop|status
#
# start: apt-get install slurm-wlm munge when missing; then, all under REPO/.cache/slurm/, a munge
#        key and a munged of our own (its own socket: the machine's munged, if any, is left
#        alone), a slurm.conf of one node named after this host (8 CPUs, Gres=gpu:4, no
#        accounting database, proctrack/linuxproc, task/none, select/cons_tres) and a gres.conf
#        whose four GPUs are character devices made with mknod (c 195 N) under
#        .cache/slurm/dev: never /dev/nvidia*, where other tests look for GPUs. slurmctld and
#        slurmd run without systemd, as root. It waits until the node is idle (sinfo).
#        Its last line says what it did, or why it could not: then .cache/slurm.unavailable holds
#        that reason (one line) and the tier's tests skip with it; exit 0 either way.
# stop:  the daemons this script started (their pidfiles), then the device nodes.
# status: the node as sinfo sees it; exit 1 when the controller does not answer.
#
# The tests and the benchmark reach it with SLURM_CONF=REPO/.cache/slurm/slurm.conf.
# `.ci/run`:  ci/install-slurm.sh start >.cache/install-slurm.out;  trap '... stop' EXIT
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="$REPO/.cache/slurm"
UNAVAILABLE="$REPO/.cache/slurm.unavailable"
CONF="$STATE/slurm.conf"
export SLURM_CONF="$CONF"
START_TIMEOUT="${SLURM_START_TIMEOUT:-60}"
started_at=$SECONDS

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

give_up() { # one line, a reason the tests can show, exit 0: the tier is skipped, not failed
  mkdir -p "$REPO/.cache"
  echo "$1" >"$UNAVAILABLE"
  echo "slurm tier: skipped: $1"
  exit 0
}

poll() { # SECONDS COMMAND...: until COMMAND succeeds; 1 when the time is up
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

alive() { # PIDFILE NAME: the process the pidfile names runs, and is NAME (not a recycled pid)
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ -n $pid ]] && grep -qaF "$2" "/proc/$pid/cmdline" 2>/dev/null
}

node_up() { # 0 once the node takes jobs; gives up at once when slurmd registered it unusable
  local state
  state=$(sinfo -h -N -o '%T %E' 2>/dev/null | head -n 1)
  [[ $state =~ ^(inval|drain) ]] && give_up "the node registered as ${state} (see .cache/slurm/slurmd.log)"
  [[ $state =~ ^(idle|mixed|allocated) ]]
}

install_packages() {
  local missing=()
  for package in slurm-wlm munge; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$package")
  done
  [[ ${#missing[@]} == 0 ]] && return 0
  { as_root apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >"$STATE/apt.log" 2>&1; } ||
    give_up "apt-get install ${missing[*]} failed (see .cache/slurm/apt.log)"
}

write_config() {
  local host plugins
  host=$(hostname -s)
  plugins=$(dirname "$(dpkg -L slurm-wlm-basic-plugins 2>/dev/null | grep -m1 '/select_cons_tres.so$')")
  [[ -d $plugins ]] || give_up "no select_cons_tres.so in slurm-wlm-basic-plugins"
  mkdir -p "$STATE/dev" "$STATE/spool/d" "$STATE/spool/ctld"
  for n in 0 1 2 3; do # fake GPUs: nvidia's major number, where only this tier looks
    [[ -c $STATE/dev/nvidia$n ]] || mknod "$STATE/dev/nvidia$n" c 195 "$n" ||
      give_up "mknod of the fake GPU devices failed (no CAP_MKNOD?)"
  done
  cat >"$CONF" <<EOF
# One node on this machine, written by ci/install-slurm.sh (the slurm test tier)
ClusterName=ralph
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/munge.socket
CredType=cred/munge
PluginDir=$plugins
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerParameters=sched_interval=1
MinJobAge=600
KillWait=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 RealMemory=1000 Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  cat >"$STATE/gres.conf" <<EOF
NodeName=$host Name=gpu File=$STATE/dev/nvidia[0-3]
EOF
}

start_munge() {
  if [[ ! -s $STATE/munge.key ]]; then
    (umask 077 && dd if=/dev/urandom of="$STATE/munge.key" bs=1 count=1024 status=none)
  fi
  alive "$STATE/munged.pid" munged && return 0
  # --force: the checkout's folders may be group-writable; the key and socket are ours alone
  munged --force --key-file="$STATE/munge.key" --socket="$STATE/munge.socket" \
    --pid-file="$STATE/munged.pid" --log-file="$STATE/munged.log" \
    --seed-file="$STATE/munged.seed" >>"$STATE/munged.out" 2>&1 ||
    give_up "munged did not start (see .cache/slurm/munged.log)"
}

start() {
  mkdir -p "$STATE"
  rm -f "$UNAVAILABLE"
  [[ "$(id -u)" == 0 ]] || command -v sudo >/dev/null ||
    give_up "needs root to install and run slurmd (uid $(id -u), no sudo)"
  install_packages
  command -v slurmctld >/dev/null || give_up "no slurmctld after installing slurm-wlm"
  [[ "$(id -u)" == 0 ]] || give_up "slurmd must run as root here (uid $(id -u))"
  write_config
  start_munge
  alive "$STATE/slurmctld.pid" slurmctld ||
    setsid slurmctld -c -i -f "$CONF" </dev/null >>"$STATE/slurmctld.out" 2>&1 ||
    give_up "slurmctld did not start (see .cache/slurm/slurmctld.log)"
  alive "$STATE/slurmd.pid" slurmd ||
    setsid slurmd -f "$CONF" </dev/null >>"$STATE/slurmd.out" 2>&1 ||
    give_up "slurmd did not start (see .cache/slurm/slurmd.log)"
  poll "$START_TIMEOUT" node_up ||
    give_up "the node did not come up within ${START_TIMEOUT} s: $(sinfo -h -N -o '%T %E' 2>&1 | head -n 1)"
  echo "slurm tier: ready in $((SECONDS - started_at)) s: $(sinfo -V) one node $(hostname -s)," \
    "4 fake GPUs in .cache/slurm/dev; SLURM_CONF=$CONF"
}

stop_one() { # NAME: TERM the daemon of our pidfile, KILL after 10 s
  local pidfile="$STATE/$1.pid" pid
  alive "$pidfile" "$1" || return 0
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  poll 10 eval "! alive '$pidfile' '$1'" || kill -KILL "$pid" 2>/dev/null || true
}

stop() {
  [[ -f $CONF ]] && scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
  stop_one slurmd
  stop_one slurmctld
  stop_one munged
  rm -rf "$STATE/dev"
  echo "slurm: stopped"
}

status() {
  [[ -f $CONF ]] || { echo "slurm: not configured (ci/install-slurm.sh start)"; exit 1; }
  sinfo -N -o '%N %T %G %C' || exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: ci/install-slurm.sh start|stop|status" >&2; exit 2 ;;
esac
