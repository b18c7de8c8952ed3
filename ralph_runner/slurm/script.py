"""The batch script of one loop: its sbatch options, and the rules a Slurm job adds to a loop.

It is meant to be read and kept (`ralph-run slurm submit --check` prints it): plain bash, every
value shell-quoted, one comment per rule. The rules live here and in the loop's exit codes:

- the loop runs on the node Slurm picked, in its workdir on the shared filesystem, with the GPUs
  Slurm gave (CUDA_VISIBLE_DEVICES): the runbook's server starts inside the allocation;
- exit 4 (the server could not be recovered on this node) requeues the job, at most
  max_requeues times, optionally never again on this node; the loop resumes from its state;
- Slurm's USR1, stop_before_end s before the time limit, asks the loop to pause (it settles the
  item in hand, then holds); once it holds, SIGTERM ends it without cutting an attempt, and the
  job is requeued (a finished checklist ends the next attempt at once);
- scancel sends SIGTERM: the loop runs its teardown and exits 143, nothing is requeued.

Each attempt appends its start and its end to `.ralph/slurm/attempts.jsonl` in the workdir.
Slurm delays a requeued job's start (its begin time); a helper left behind by the attempt sets
StartTime=now 1.1 s after the job is pending again (a node refuses a credential made in the
second the job's old one was revoked, and Slurm then fails the job). It outlives the attempt
only where Slurm tracks a job's processes by their parentage (ProctrackType=proctrack/linuxproc);
under proctrack/cgroup it is killed with the attempt, and the requeued job starts when Slurm's
delay is over.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

from ralph_runner.slurm.jobs import Resolved
from ralph_runner.slurm.submissions import RECORD_DIR, attempts_path

SERVER_GAVE_UP = 4  # the loop's exit code: the service could not be recovered


def ralph_run_command(job: Resolved) -> str:
    """The ralph-run the node runs: the jobs file's `ralph_run`, else the one submitting."""
    if job.ralph_run:
        return job.ralph_run
    beside = Path(sys.executable).with_name("ralph-run")
    return str(beside) if beside.exists() else shutil.which("ralph-run") or "ralph-run"


def sbatch_options(job: Resolved) -> list[str]:
    """The `#SBATCH` options, in the order they are written."""
    record = job.workdir / RECORD_DIR
    options = [
        f"--job-name=ralph-{job.name}",
        f"--chdir={job.workdir}",
        f"--output={record}/job-%j.out",  # every attempt of the job appends to one file
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{job.stop_before_end}",
    ]
    if job.gpus:
        options.append(f"--gres=gpu:{job.gpus}")
    for flag, value in (
        ("partition", job.partition),
        ("time", job.time),
        ("account", job.account),
        ("constraint", job.constraint),
        ("cpus-per-task", job.cpus),
    ):
        if value is not None:
            options.append(f"--{flag}={value}")
    return [*options, *job.sbatch]


def render(job: Resolved) -> str:
    """The whole batch script."""
    q = shlex.quote
    header = "\n".join(f"#SBATCH {q(option)}" for option in sbatch_options(job))
    settings = "\n".join(
        [
            f"ralph_run={q(ralph_run_command(job))}",
            f"runbook={q(str(job.runbook))}",
            f"workdir={q(str(job.workdir))}",
            f"attempts={q(str(attempts_path(job.workdir)))}",
            f"extra_vars={q(json.dumps(job.vars, sort_keys=True))}",
            f"max_requeues={job.max_requeues}",
            f"exclude_failed_node={int(job.exclude_failed_node)}",
        ]
    )
    return TEMPLATE.format(name=job.name, header=header, settings=settings)


TEMPLATE = """\
#!/bin/bash
# The ralph-run loop {name!r} as a Slurm job, written by `ralph-run slurm submit`: keep it and
# `sbatch` it as it is if you like. Docs: docs/slurm.md.
{header}
set -uo pipefail

{settings}
attempt=${{SLURM_RESTART_COUNT:-0}}
mkdir -p "$(dirname "$attempts")"

note() {{  # EVENT EXIT_CODE: one JSON line in the workdir's attempts.jsonl
  local line='{{"job": "%s", "attempt": %s, "node": "%s", "gpus": "%s", "event": "%s", '
  printf "$line"'"exit": %s, "at": %s}}\\n' "$SLURM_JOB_ID" "$attempt" \\
    "${{SLURMD_NODENAME:-}}" "${{CUDA_VISIBLE_DEVICES:-}}" "$1" "$2" "$(date +%s.%N)" >>"$attempts"
}}

paused() {{ "$ralph_run" status "$workdir" --json 2>/dev/null | grep -q '"paused": true'; }}

# Slurm's USR1 before the time limit: the loop pauses after the item in hand; once it holds,
# SIGTERM ends it there (no attempt cut, no strike) and the job is requeued below.
on_time_limit() {{
  stopping=time-limit
  "$ralph_run" pause "$workdir" >/dev/null
  ( until paused || ! kill -0 "$loop" 2>/dev/null; do sleep 0.2; done
    kill -TERM "$loop" 2>/dev/null ) &
}}

# scancel (and Slurm's end of the time limit): SIGTERM to the loop, which runs its teardown.
on_term() {{
  stopping=${{stopping:-cancelled}}
  kill -TERM "$loop" 2>/dev/null
}}

requeue() {{  # WHY EXIT_CODE: back to pending; a helper that outlives this attempt starts it now
  note "$1" "$2"
  local node=${{SLURMD_NODENAME:-}} update=(StartTime=now)
  [[ $exclude_failed_node == 1 && $1 == requeue-server && -n $node ]] &&
    update+=("ExcNodeList=$node")
  # Slurm's node refuses a job credential made in the second its old one was revoked (the
  # job fails: "Job credential revoked"): the helper waits 1.1 s once the job is pending.
  ( setsid bash -c 'for _ in $(seq 600); do
      if scontrol show job -o "$1" | grep -q "JobState=PENDING"; then
        sleep 1.1
        exec scontrol update jobid="$1" "${{@:2}}"
      fi
      sleep 0.1
    done' requeue-helper "$SLURM_JOB_ID" "${{update[@]}}" </dev/null >/dev/null 2>&1 & )
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}}

note start null
stopping=
"$ralph_run" "$runbook" -e "$extra_vars" &
loop=$!
trap on_time_limit USR1
trap on_term TERM
code=
while [[ -z $code ]]; do  # a trap interrupts `wait`: wait again until the loop has ended
  wait "$loop"
  status=$?
  kill -0 "$loop" 2>/dev/null || code=$status
done
trap - USR1 TERM
if [[ $stopping == time-limit ]]; then
  "$ralph_run" resume "$workdir" >/dev/null  # the pause asked above must not hold the next run
  [[ $code == 0 ]] || requeue requeue-time-limit "$code"
fi
this_job=$(printf '"job": "%s"' "$SLURM_JOB_ID")
server_requeues=$(grep -F "$this_job" "$attempts" | grep -c '"event": "requeue-server"')
if [[ $code == {gave_up} && -z $stopping ]] && ((server_requeues < max_requeues)); then
  requeue requeue-server "$code"
fi
note "${{stopping:-end}}" "$code"
exit "$code"
""".replace("{gave_up}", str(SERVER_GAVE_UP))
