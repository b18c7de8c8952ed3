"""A loop's Slurm record, in its workdir on the shared filesystem (`.ralph/slurm/`).

`submission.json` says which job runs the loop now (its id, name, jobs file, when it was
submitted), `script.sh` is the batch script as submitted, `attempts.jsonl` holds a line per
start and end of each attempt (written by the batch script: node, GPUs, exit code, requeue), and
`job-ID.out` is Slurm's output of every attempt. The loop's own state (`.ralph/state.json`, the
death log) sits beside them: a requeued job on any node resumes from it.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson
from pydantic import BaseModel, ValidationError

from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError, Problem
from ralph_runner.workspace.state_files import STATE_DIR

RECORD_DIR = Path(STATE_DIR) / "slurm"


class Submission(BaseModel):
    """submission.json: the job that runs this workdir's loop."""

    job_id: str
    name: str
    jobs_file: str
    submitted: float  # unix time


class Attempt(BaseModel):
    """One line of attempts.jsonl: an attempt's start, or its end and what followed."""

    job: str
    attempt: int
    node: str
    gpus: str  # CUDA_VISIBLE_DEVICES as Slurm set it
    # start, end (the loop ended; exit code), cancelled, time-limit, requeue-server,
    # requeue-time-limit
    event: str
    exit: int | None
    at: float


def record_dir(workdir: Path) -> Path:
    return workdir / RECORD_DIR


def attempts_path(workdir: Path) -> Path:
    return record_dir(workdir) / "attempts.jsonl"


def script_path(workdir: Path) -> Path:
    return record_dir(workdir) / "script.sh"


def save(workdir: Path, job_id: str, name: str, jobs_file: Path) -> Submission:
    submission = Submission(
        job_id=job_id, name=name, jobs_file=str(jobs_file), submitted=time.time()
    )
    write_atomic(record_dir(workdir) / "submission.json", orjson.dumps(submission.model_dump()))
    return submission


def write_script(workdir: Path, text: str) -> Path:
    path = script_path(workdir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())
    path.chmod(0o755)
    return path


def load(workdir: Path) -> Submission | None:
    """The workdir's submission; None when none was made (never submitted)."""
    path = record_dir(workdir) / "submission.json"
    try:
        return Submission.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except ValidationError as error:
        why = f"not a submission record: {error.errors()[0]['msg']}"
        raise FatalError(Problem(why, str(path))) from None


def attempts(workdir: Path, job_id: str | None = None) -> list[Attempt]:
    """attempts.jsonl's lines (of one job when `job_id` is given); a torn last line is skipped."""
    try:
        lines = attempts_path(workdir).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            attempt = Attempt.model_validate_json(line)
        except ValidationError:
            continue
        if job_id is None or attempt.job == job_id:
            found.append(attempt)
    return found
