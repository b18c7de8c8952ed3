"""Slurm's commands (sbatch, squeue, sacct, scontrol, scancel), run through ralph-run's one
process path (process/execute.py): each with a deadline and its output size-capped. They find
the cluster as they always do (/etc/slurm, or SLURM_CONF in the environment)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ralph_runner.errors import ExitCode, FatalError
from ralph_runner.process import execute

TIMEOUT = 30.0  # seconds: a controller that does not answer within it is an error, not a hang
MAX_OUTPUT = 256 * 1024


@dataclass(frozen=True)
class JobState:
    """Slurm's view of one job: squeue's, or sacct's once it left squeue."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...; UNKNOWN when Slurm forgot
    node: str  # where it runs or ran; the reason it waits while pending
    elapsed: str
    limit: str


def _slurm(argv: list[str], what: str, stdin: str | None = None) -> execute.Result:
    result = execute.run(argv, timeout=TIMEOUT, max_output=MAX_OUTPUT, stdin=stdin)
    if result.exit_code == execute.CANNOT_START:
        raise FatalError(f"{what}: {result.output.strip()} (is Slurm installed here?)")
    return result


def _failed(result: execute.Result, what: str) -> FatalError:
    why = "timed out" if result.timed_out else result.output.strip().splitlines()[-1:]
    return FatalError(f"{what} failed: {why}", exit_code=ExitCode.PARTIAL)


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT`: the new job's id."""
    result = _slurm(["sbatch", "--parsable", str(script)], "sbatch")
    if not result.ok:
        raise _failed(result, f"sbatch {script}")
    return result.output.strip().splitlines()[-1].split(";")[0]


SQUEUE_FORMAT = "%i|%T|%R|%M|%l"


def states(job_ids: list[str]) -> dict[str, JobState]:
    """Every job's state: squeue's (recent ended jobs too), sacct's for the ones it forgot."""
    if not job_ids:
        return {}
    argv = ["squeue", "--states=all", "-h", "-j", ",".join(job_ids), "-o", SQUEUE_FORMAT]
    result = _slurm(argv, "squeue")
    found: dict[str, JobState] = {}
    for line in result.output.splitlines() if result.ok else []:
        fields = line.strip().split("|")
        if len(fields) == 5 and fields[0] in job_ids:
            found[fields[0]] = JobState(*fields)
    missing = [job_id for job_id in job_ids if job_id not in found]
    return {**found, **_from_sacct(missing)}


def _from_sacct(job_ids: list[str]) -> dict[str, JobState]:
    if not job_ids:
        return {}
    argv = ["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids)]
    result = _slurm([*argv, "-o", "JobID,State,NodeList,Elapsed,Timelimit"], "sacct")
    found = {}
    for line in result.output.splitlines() if result.ok else []:
        fields = line.strip().split("|")
        if len(fields) == 5 and fields[0] in job_ids:
            found[fields[0]] = JobState(fields[0], fields[1].split()[0], *fields[2:])
    for job_id in job_ids:  # neither knows it any more (no accounting, past MinJobAge)
        found.setdefault(job_id, JobState(job_id, "UNKNOWN", "", "", ""))
    return found


def cancel(job_id: str) -> None:
    """`scancel ID`: SIGTERM to the job's processes; the loop runs its teardown."""
    result = _slurm(["scancel", job_id], "scancel")
    if not result.ok:
        raise _failed(result, f"scancel {job_id}")
