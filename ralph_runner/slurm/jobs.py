"""The jobs file: which loops to submit to Slurm, and with which sbatch options.

One YAML file of its own (not the inventory: a Slurm job is not a host one reaches over ssh):
the runbook, the options every job shares under `defaults:`, and one entry per loop under
`jobs:`, each with its workdir on the shared filesystem and whatever it sets differently. It is
validated at once, every problem with its file, line, column and key path (exit 2).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ralph_runner.errors import FatalError
from ralph_runner.runbook import schema, yamlfile

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # a job's name: a word in a file name and in squeue
TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # sbatch --time: MM, MM:SS, H:MM:SS, D-H[:M[:S]]


class Options(BaseModel):
    """The sbatch options of a job; under `defaults:` the ones every job starts from."""

    model_config = ConfigDict(extra="forbid")

    partition: str | None = None  # --partition; None: the cluster's default partition
    gpus: Annotated[int, Field(ge=0)] | None = None  # --gres=gpu:N
    time: str | None = None  # --time (the job's limit): `MM`, `H:MM:SS`, `D-HH:MM:SS`
    account: str | None = None  # --account
    constraint: str | None = None  # --constraint: node features, e.g. "a100&ib"
    cpus: Annotated[int, Field(ge=1)] | None = None  # --cpus-per-task
    # seconds before the time limit at which Slurm sends USR1: the loop stops at its next item
    # boundary and the job is requeued while items remain (--signal=B:USR1@N)
    stop_before_end: Annotated[int, Field(ge=1)] | None = None
    # requeues after the server could not be recovered (exit 4); 0: none. A time-limit stop is
    # always requeued while items remain (it is progress, not a failure)
    max_requeues: Annotated[int, Field(ge=0)] | None = None
    exclude_failed_node: bool | None = None  # a requeue after exit 4 avoids the node it ran on
    sbatch: list[str] | None = None  # further sbatch options, as they are written: "--qos=long"
    vars: dict[str, str | int | float | bool] | None = None  # the run's -e variables

    @model_validator(mode="after")
    def _time_format(self) -> Options:
        if self.time is not None and not TIME.match(self.time):
            raise ValueError(f"time {self.time!r} is not sbatch's: MM, H:MM:SS or D-HH:MM:SS")
        return self


class Job(Options):
    """One loop: its name, its workdir (on a filesystem every node sees), its own options."""

    name: str = Field(pattern=NAME)
    workdir: str


class JobsFile(BaseModel):
    """The whole file."""

    model_config = ConfigDict(extra="forbid")

    runbook: str  # relative to the jobs file
    ralph_run: str | None = None  # the ralph-run every node runs; default: the one submitting
    defaults: Options = Options()
    jobs: list[Job] = Field(min_length=1)


DEFAULTS = Options(  # what neither the job nor `defaults:` says
    gpus=1, stop_before_end=120, max_requeues=3, exclude_failed_node=False, sbatch=[], vars={}
)


class Resolved(BaseModel):
    """One job with its options resolved (job, then `defaults:`, then DEFAULTS) and its paths
    absolute: what the batch script is written from."""

    name: str
    workdir: Path
    runbook: Path
    jobs_file: Path
    ralph_run: str | None
    partition: str | None
    gpus: int
    time: str | None
    account: str | None
    constraint: str | None
    cpus: int | None
    stop_before_end: int
    max_requeues: int
    exclude_failed_node: bool
    sbatch: list[str]
    vars: dict[str, str | int | float | bool]


def load(path: str | Path) -> list[Resolved]:
    """The jobs of a jobs file, resolved; every problem at once (FatalError, exit 2)."""
    path = Path(path).resolve()
    document = yamlfile.load(path)
    if not isinstance(document.data, dict):
        raise FatalError(document.problem((), "a jobs file must be a mapping of keys"))
    model: JobsFile = schema.validate(document, JobsFile)
    problems = []
    names: dict[str, int] = {}
    for index, job in enumerate(model.jobs):
        if job.name in names:
            problems.append(
                document.problem(
                    ("jobs", index, "name"),
                    f"job name {job.name!r} is also jobs[{names[job.name]}]'s: names are unique",
                )
            )
        names.setdefault(job.name, index)
    runbook = (path.parent / model.runbook).resolve()
    if not runbook.is_file():
        problems.append(document.problem(("runbook",), f"no such runbook: {runbook}"))
    if problems:
        raise FatalError(problems)
    return [_resolve(job, model, path, runbook) for job in model.jobs]


def _resolve(job: Job, model: JobsFile, path: Path, runbook: Path) -> Resolved:
    def pick(key: str) -> object:
        for source in (job, model.defaults, DEFAULTS):
            value = getattr(source, key)
            if value is not None:
                return value
        return None

    fields = {key: pick(key) for key in Options.model_fields if key != "vars"}
    variables = {**(DEFAULTS.vars or {}), **(model.defaults.vars or {}), **(job.vars or {})}
    return Resolved.model_validate(
        {
            **fields,
            "vars": variables,
            "name": job.name,
            "workdir": (path.parent / job.workdir).resolve(),
            "runbook": runbook,
            "jobs_file": path,
            "ralph_run": model.ralph_run,
        }
    )


def pick(jobs: list[Resolved], name: str | None) -> list[Resolved]:
    """All the jobs, or the one named (`--job NAME`); an unknown name is an error (exit 2)."""
    if name is None:
        return jobs
    found = [job for job in jobs if job.name == name]
    if not found:
        known = ", ".join(job.name for job in jobs)
        raise FatalError(f"no job named {name!r} in {jobs[0].jobs_file} (its jobs: {known})")
    return found
