"""`.ralph/status.json`, declared once: its name, its shape, the one writer and the one reader.

The loop (loop/runner.py) rewrites it at every step; `ralph-run status`, `top`, `status -i` and
`pause` read it, on this host or over a connection. It is a view of the run's state, so the
shapes of the state's records it shows (the last death, the last start, why the agent is
broken, the usage limit) are declared here too, below the packages that fill them.

A reader may meet a file that an older ralph-run wrote (a key it did not have yet), a partial
one (the test tools write a few keys) or one a newer ralph-run wrote (keys this one does not
know): `read` never fails on those. Every key of `Status` is checked against its declared type;
a missing key or one of the wrong type reads as its default (what a loop that never ran would
show: 0, False, None, ""), nested records key by key the same way, and unknown keys are kept as
they are, so `status --json` passes on what a newer writer said (workspace/json_records.py).
Only a file that is not a JSON object at all is an error (FatalError, with how to start over).
"""

# No `from __future__ import annotations`: `read` checks values against these annotations at run
# time (json_records), and Python 3.11 sees NotRequired only in evaluated annotations.

from pathlib import Path
from typing import Literal, NotRequired, TypedDict

from ralph_runner.durable.json_value import JSON
from ralph_runner.durable.redaction import Redactor
from ralph_runner.workspace.json_records import conformed
from ralph_runner.workspace.state_files import STATE_DIR, corrupt, read_json, write_json

STATUS_FILE = "status.json"
SNAPSHOT = "snapshot"  # what deleting the file loses, in its error's hint


class LastDeath(TypedDict):
    """The service's last death (liveness/service.py): in state.json and status.json."""

    death: int  # its number in this workdir
    time: str  # ISO 8601
    phase: str  # when it was found: before-iteration, during-step, ...
    item: str | None  # the checklist item in hand
    reason: str  # the evidence, in words
    fault: str  # the death's class (liveness/faults.py)


class LastStart(TypedDict):
    """The service was not running at the run's first check, and the loop started it."""

    time: str
    recovered: bool
    seconds: float
    reason: str | None  # why it could not be started


class AgentBrokenStatus(TypedDict):
    """Why the loop stopped with exit 6: the same failure on two items (loop/failures.py)."""

    reason: str
    output_tail: str
    items: list[str]  # the two items that failed the same way
    skipped: list[str]  # the items skipped while the failures kept matching


class LimitedStatus(TypedDict):
    """The agent's usage limit the loop waits for, or the one that stopped it (exit 7)."""

    item: str
    source: str  # the step whose output said it
    line: str  # the line that said it
    reset_at: float  # epoch of the reset (now + default_wait when the message gave none)
    until: float  # epoch until which the loop waits


class HangBound(TypedDict):
    """The progress probes' hang bound (docs: hangs): seconds without an engine step."""

    seconds: float
    why: str


class Pause(TypedDict):
    """`ralph-run pause` in hand (loop/pause.py): requested, paused, or resuming."""

    state: Literal["pausing", "paused", "resuming"]
    since: float | None  # epoch when the wait began
    requested: float | None  # epoch of the request
    now: bool  # `pause --now`: the step in hand is stopped
    by: str | None  # who asked (user@host)
    killed_step: str | None  # the step --now stopped
    steps: Literal["running", "done", "failed"] | None  # the pause (or resume) block; None: none
    steps_error: str | None  # why that block failed


class Held(TypedDict):
    """The marker `.ralph/held` (loop/lifecycle.py): a run's setup succeeded, its teardown has
    not run yet; found by the next run after a kill -9."""

    pid: int | None  # the run that wrote it
    since: float | None  # epoch when its setup succeeded
    host: str | None  # where ralph-run ran


class LifecycleStatus(TypedDict):
    """The runbook's `setup:` and `teardown:` blocks (loop/lifecycle.py) in this run."""

    setup: Literal["running", "done", "failed"] | None  # None: not run (yet)
    teardown: Literal["running", "done", "failed"] | None
    error: str | None  # why a block failed: its step and how it ended
    held: bool  # setup succeeded and teardown has not: the marker is there
    left_by_last_run: Held | None  # the marker a run killed before its teardown left


class ChecklistFields(TypedDict, total=False):
    """The checklist's counts (checklist.Counts); absent until the checklist was read."""

    done: int
    todo: int
    skipped: int
    chars: int
    lines: int


class PauseFields(TypedDict):
    """What loop/pause.py says in the status: the pause, the step in hand, the attempts."""

    paused: bool
    pause: Pause | None
    step_started: float | None  # epoch of the step in hand; None between iterations
    attempts: int  # the item's strikes so far


class Worker(TypedDict):
    """One worker of `loop.workers` > 1 (loop/landing.py): its item and where it stands."""

    worker: int  # its number, 1..N: its worktree is .ralph/worktrees/<worker>
    item: str | None  # None: idle
    phase: str | None  # the step in hand, or starting / landing / waiting


class GovernorStatus(TypedDict):
    """`workers: auto` (loop/governor.py): how many may be in flight now, and why."""

    workers: int  # admitted now
    max_workers: int
    reason: str  # of the last decision
    changed: float  # epoch of the last decision (the run's start: the first worker)


class LastRejuvenation(TypedDict):
    """The last restart of a server that rotted (loop/rejuvenation.py)."""

    time: float  # epoch
    signs: list[str]
    found: str  # what the signs found, in words
    recovered: bool
    seconds: float


class RejuvenationStatus(TypedDict):
    """`health.rejuvenate`: this run's restarts before a death, by sign; one due now."""

    count: int
    by_sign: dict[str, int]
    due: list[str] | None  # the signs of a restart due at the next boundary
    last: LastRejuvenation | None


class Status(ChecklistFields, PauseFields):
    """status.json: where the loop stands, one object."""

    status: str  # one of loop/state.py's STATUSES
    pid: int | None
    running: bool  # as the loop wrote it; readers check the pid still runs
    iteration: int
    item: str | None
    phase: str | None
    deaths: int
    last_death: LastDeath | None
    last_start: LastStart | None
    agent_broken: AgentBrokenStatus | None
    limited_until: float | None
    limited: LimitedStatus | None
    failure: str | None  # why the run failed (status "failed")
    hang_bound: HangBound | None
    updated: float  # epoch of this write
    workdir: str
    crash: NotRequired[str]  # an internal error's cause (crash.py), status "crashed"
    set_aside: NotRequired[list[str]]  # items set aside as the cause of deaths (docs: deaths)
    workers: NotRequired[list[Worker]]  # with loop.workers > 1: each worker's item and phase
    governor: NotRequired[GovernorStatus]  # with workers: auto
    rejuvenation: NotRequired[RejuvenationStatus]  # with health.rejuvenate
    lifecycle: NotRequired[LifecycleStatus]  # only with `setup:`/`teardown:` or a marker left


class CheckedStatus(Status):
    """A status as its readers show it: `running` checked (its pid still runs), and whether a
    pause request outlived its loop (`.ralph/pause` left behind: the next run waits)."""

    pause_left: bool


def checked(status: Status, alive: bool, pause_file: bool) -> CheckedStatus:
    """The status with `running` true only while its pid is `alive`, and `pause_left` when the
    loop is not running and its pause file is there."""
    running = status["running"] and alive
    return {**status, "running": running, "pause_left": not running and pause_file}


def path(workdir: Path) -> Path:
    """Where a workdir's status is."""
    return workdir / STATE_DIR / STATUS_FILE


def write(workdir: Path, status: Status, redactor: Redactor | None = None) -> None:
    """Replace the status atomically (readers see the old or the new one, never half), not
    fsynced: it is a view of the state, rewritten at every step. Secrets masked. FatalError
    naming the file when it cannot be written."""
    write_json(path(workdir), status, redactor, durable=False)


def read(workdir: Path) -> Status | None:
    """The workdir's status; None when there is none (never run here). Tolerant of older,
    partial and newer files (see the module's text); FatalError when it is not a JSON object."""
    target = path(workdir)
    data = read_json(target, SNAPSHOT)
    return None if data is None else parse(data, target)


def parse(data: JSON, where: Path) -> Status:
    """A status as read (from the file, or another host's through a shell): conformed as the
    module's text says; FatalError when it is not a JSON object."""
    if not isinstance(data, dict):
        raise corrupt(where, "expected a JSON object", SNAPSHOT)
    return conformed(Status, data)
