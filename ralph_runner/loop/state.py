"""The loop's durable state under <workdir>/.ralph/: a killed run restarts where it stopped.

Every file here is replaced atomically (temp file, rename), so a run killed with SIGKILL leaves
either the old or the new content, never half of it; state.json is also fsynced (file and
directory) whenever strikes, deaths or the run's status change, so a power cut loses none of them.
One run at a time owns a workdir: `.ralph/lock` is held with flock, which the kernel releases when
the holder dies, so a lock left behind by a killed run is simply taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from ralph_runner.durable import files
from ralph_runner.durable.json_value import JSON
from ralph_runner.errors import ExitCode, FatalError, Problem
from ralph_runner.process import private_dir
from ralph_runner.workspace import json_records, status_file
from ralph_runner.workspace.state_files import (
    STATE_DIR,
    STATE_FILE,
    corrupt,
    read_json,
    write_json,
)
from ralph_runner.workspace.status_file import (
    AgentBrokenStatus,
    LastDeath,
    LastStart,
    LimitedStatus,
    Status,
)

if TYPE_CHECKING:
    from ralph_runner.durable.redaction import Redactor

# The run states, Supervisor-style: a fixed set, and the moves allowed between them.
STATUSES = (
    "idle",  # never run
    "running",  # a run holds the workdir (or was killed with -9 while it did)
    "finished",  # the checklist is done (exit 0)
    "stopped",  # max_iterations reached with items left (exit 5)
    "gave-up",  # the service could not be recovered (recovery.exit_code)
    "agent-broken",  # the agent failed the same way on two items (exit 6)
    "limited",  # the agent's usage limit resets later than limits.max_wait (exit 7)
    "interrupted",  # SIGINT/SIGTERM (exit 130/143)
    "failed",  # a FatalError in the run, e.g. a template error in a step (exit 2)
    "crashed",  # an unexpected exception: a bug in ralph-run (exit 70)
)
ENDED = STATUSES[2:]
TRANSITIONS: dict[str, frozenset[str]] = {
    "idle": frozenset({"running"}),
    # running -> running: a run killed with -9 left "running" behind; the next one resumes it
    "running": frozenset(STATUSES[1:]),
    **{ended: frozenset({"running"}) for ended in ENDED},
}
# A run that starts from these starts over (its own max_iterations, its iteration numbers going
# on from the last run's); from the others it resumes.
STARTS_OVER = frozenset({"idle", "finished", "stopped", "gave-up", "agent-broken"})

# What changes at every iteration and step: saved with a rename, fsynced with the rest only (a
# power cut may set the iteration count back by the healthy iterations since).
VOLATILE = frozenset({"iteration", "current_item", "phase"})
STATE_LOST = "iteration count, strikes and deaths"  # what deleting state.json loses


class LastFailure(TypedDict):
    """The last failed attempt charged to an item (failures.Failure.as_dict)."""

    item: str
    reason: str
    output_tail: str
    signatures: list[str]  # what the broken-agent rule compares


class StateRecord(TypedDict, total=False):
    """state.json: State's fields as saved. A file from an older ralph-run may lack some (they
    keep State's defaults); one from a newer ralph-run may have more (ignored)."""

    iteration: int
    run_from: int
    strikes: dict[str, int]
    deaths: int
    death_times: list[float]
    current_item: str | None
    phase: str | None
    pid: int | None
    started: float | None
    status: str
    last_death: LastDeath | None
    last_start: LastStart | None
    last_failure: LastFailure | None
    streak_skipped: list[str]
    item_deaths: dict[str, int]
    suspects: list[str]
    set_aside: list[str]
    agent_broken: AgentBrokenStatus | None
    limited: LimitedStatus | None
    error: str | None


@dataclass
class State:
    """What a restarted run needs to continue: counters, strikes, the item in hand."""

    iteration: int = 0  # the last iteration's number; numbers go on across runs in a workdir
    run_from: int = 0  # `iteration` when this run started over: max_iterations counts from here
    strikes: dict[str, int] = field(default_factory=dict)  # item text -> strikes so far
    deaths: int = 0
    death_times: list[float] = field(default_factory=list)  # epoch seconds, for crash-loop windows
    current_item: str | None = None
    phase: str | None = None
    pid: int | None = None
    started: float | None = None  # epoch of the first start of this run
    status: str = "idle"  # one of STATUSES
    last_death: LastDeath | None = None
    last_start: LastStart | None = None  # the service was not running and the loop started it
    # The broken-agent rule (failures.py): the last failed attempt, the items skipped while
    # failures kept matching, and why the loop stopped with exit 6 (None once a run starts).
    last_failure: LastFailure | None = None
    streak_skipped: list[str] = field(default_factory=list)
    # Deaths an item causes (loop/blame.py): deaths in a row with each item alone in flight,
    # the items in flight together at a death (run one at a time), the items set aside
    item_deaths: dict[str, int] = field(default_factory=dict)
    suspects: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)
    agent_broken: AgentBrokenStatus | None = None
    # A usage limit (limits.py) waited for, or the one that stopped the run (exit 7); None once
    # the wait is over or a run starts.
    limited: LimitedStatus | None = None
    # Why the run failed (status "failed", exit 2): the error as the console printed it; None
    # once a run starts. `ralph-run status` shows it.
    error: str | None = None

    def to_dict(self) -> StateRecord:
        return {
            "iteration": self.iteration,
            "run_from": self.run_from,
            "strikes": dict(self.strikes),
            "deaths": self.deaths,
            "death_times": list(self.death_times),
            "current_item": self.current_item,
            "phase": self.phase,
            "pid": self.pid,
            "started": self.started,
            "status": self.status,
            "last_death": self.last_death,
            "last_start": self.last_start,
            "last_failure": self.last_failure,
            "streak_skipped": list(self.streak_skipped),
            "item_deaths": dict(self.item_deaths),
            "suspects": list(self.suspects),
            "set_aside": list(self.set_aside),
            "agent_broken": self.agent_broken,
            "limited": self.limited,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: JSON) -> State:
        """Build a State from saved data; unknown keys are ignored (a newer ralph-run wrote them),
        and a record that lacks a key (an older one did not write it) gets its default.

        Raises ValueError when a known key holds the wrong type.
        """
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        for name, hint in _FIELDS.items():
            value = data.get(name)
            if name in data and not (json_records.fits(hint, value) and _fits_more(name, value)):
                raise ValueError(f"{name!r} has an invalid value: {value!r}")
        known = {name: data[name] for name in _FIELDS if name in data}
        return cls(**json_records.conformed(StateRecord, known))


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in ralph-run, not something an operator did."""


def move(state: State, to: str) -> None:
    """The one way the run's status changes: refuses a move TRANSITIONS does not allow."""
    if to not in TRANSITIONS.get(state.status, ()):
        raise IllegalTransition(f"run status cannot move from {state.status!r} to {to!r}")
    state.status = to


_FIELDS = json_records.hints(StateRecord)  # each saved field's type, checked by from_dict


def _fits_more(name: str, value: JSON) -> bool:
    """What the types do not say: the status is one of STATUSES, run_from no negative count."""
    if name == "status":
        return value in STATUSES
    if name == "run_from":
        return isinstance(value, int) and value >= 0
    return True


class Store:
    """The files of `<workdir>/.ralph/`: state.json, status.json and the lock.

    redactor: masks secrets in everything written (a death's reason carries the probe URL).
    warn: told what could not be written where the loop goes on anyway (the lock's pid).
    """

    def __init__(
        self,
        workdir: Path,
        redactor: Redactor | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.redactor = redactor
        self.warn = warn or (
            lambda message: print(f"ralph-run: warning: {message}", file=sys.stderr)
        )
        self.workdir = Path(workdir)
        self.dir = self.workdir / STATE_DIR
        self.state_path = self.dir / STATE_FILE
        self.status_path = status_file.path(self.workdir)
        self.lock_path = self.dir / "lock"
        self._durable: dict[str, object] | None = None  # the state last fsynced, less VOLATILE

    def load(self) -> State:
        """The saved state, or a fresh one when this workdir has never been run."""
        data = read_json(self.state_path, STATE_LOST)
        if data is None:
            return State()
        try:
            return State.from_dict(data)
        except ValueError as e:
            raise corrupt(self.state_path, str(e), STATE_LOST) from None

    def save(self, state: State) -> None:
        """Replace state.json atomically (a kill -9 loses nothing); fsync it only when more than
        the iteration in hand changed (VOLATILE): strikes, deaths and the run's status survive a
        power cut too, and the two saves of every healthy iteration cost no disk flush."""
        data = state.to_dict()
        lasting = {k: v for k, v in data.items() if k not in VOLATILE}
        durable = lasting != self._durable
        write_json(self.state_path, data, self.redactor, durable=durable)
        if durable:
            self._durable = lasting

    def write_status(self, status: Status) -> None:
        """A snapshot that a cron job or a person can read without parsing logs (status_file)."""
        status_file.write(self.workdir, status, self.redactor)

    def read_status(self) -> Status | None:
        return status_file.read(self.workdir)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Own this workdir for the duration; another live ralph-run -> FatalError, exit code 3.

        The lock file is never removed (unlinking a flock file lets two runs lock two different
        inodes); on release its pid is cleared instead. The fd is not inherited by children, so
        an agent left running by a killed ralph-run does not keep the workdir locked.
        """
        try:
            files.state_directory(self.dir)  # 0700, ours: no one else plants a file in it
            fd = private_dir.open_private(self.lock_path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise FatalError(Problem(f"cannot lock: {e.strerror}", str(self.lock_path))) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                workdir = os.path.abspath(self.workdir)
                raise FatalError(
                    Problem(
                        f"another ralph-run (pid {_holder_pid(fd)}) holds {workdir}",
                        file=str(self.lock_path),
                    ),
                    exit_code=ExitCode.HELD,
                ) from None
            try:  # only for the message of a second run: a full disk must not stop this one
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as e:
                self.warn(f"{self.lock_path}: pid not written: {e.strerror} (the lock holds)")
            try:
                yield
            finally:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)


def _holder_pid(fd: int) -> str:
    """The pid the lock holder wrote, or "unknown" if it has not written it yet."""
    pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return pid if pid.isdigit() else "unknown"
