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
they are, so `status --json` passes on what a newer writer said. Only a file that is not a JSON
object at all is an error (FatalError, with how to start over).
"""

# No `from __future__ import annotations`: `read` checks values against these annotations at run
# time, and Python 3.11 sees NotRequired only in evaluated annotations.

import json
import types
import typing
from pathlib import Path
from typing import Literal, NotRequired, TypedDict, Union

from ralph_runner.durable.files import write_atomic
from ralph_runner.durable.json_value import JSON
from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import FatalError, Problem
from ralph_runner.workspace.state_files import STATE_DIR

STATUS_FILE = "status.json"


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


class AgentBroken(TypedDict):
    """Why the loop stopped with exit 6: the same failure on two items (loop/failures.py)."""

    reason: str
    output_tail: str
    items: list[str]  # the two items that failed the same way
    skipped: list[str]  # the items skipped while the failures kept matching


class Limited(TypedDict):
    """The agent's usage limit the loop waits for, or the one that stopped it (exit 7)."""

    item: str
    source: str  # the step whose output said it
    line: str  # the line that said it
    reset_at: float | None  # epoch when the limit resets, when the message said
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
    agent_broken: AgentBroken | None
    limited_until: float | None
    limited: Limited | None
    failure: str | None  # why the run failed (status "failed")
    hang_bound: HangBound | None
    updated: float  # epoch of this write
    workdir: str
    crash: NotRequired[str]  # an internal error's cause (crash.py), status "crashed"


def path(workdir: Path) -> Path:
    """Where a workdir's status is."""
    return workdir / STATE_DIR / STATUS_FILE


def write(workdir: Path, status: Status, redactor: Redactor | None = None) -> None:
    """Replace the status atomically (readers see the old or the new one, never half), not
    fsynced: it is a view of the state, rewritten at every step. Secrets masked, keys too (the
    state keeps strikes by item text). FatalError naming the file when it cannot be written."""
    target = path(workdir)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FatalError(Problem(f"cannot create: {e.strerror}", str(target.parent))) from None
    data = redactor.data(status, keys=True) if redactor is not None else status
    text = json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True) + "\n"
    write_atomic(target, text.encode("utf-8"), durable=False)


def read(workdir: Path) -> Status | None:
    """The workdir's status; None when there is none (never run here). Tolerant of older,
    partial and newer files (see the module's text); FatalError when it is not a JSON object."""
    target = path(workdir)
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise _corrupt(target, str(e)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        problem = Problem(f"{e.msg}; {_reset_hint(target)}", str(target), e.lineno, e.colno)
        raise FatalError(problem) from None
    return parse(data, str(target))


def parse(data: JSON, where: str) -> Status:
    """A status as read (from the file, or from another host's through a shell): typed as
    `read` says; FatalError when it is not a JSON object."""
    if not isinstance(data, dict):
        raise _corrupt(Path(where), "expected a JSON object")
    return typing.cast(Status, _conformed(Status, data))  # checked key by key


def _conformed(shape: type, data: dict[str, JSON]) -> dict[str, JSON]:
    """`data` as `shape` (a TypedDict) declares it: a missing or ill-typed key gets its default
    (an optional one is dropped), nested records conformed the same way, unknown keys kept."""
    required = typing.cast(frozenset[str], vars(shape)["__required_keys__"])
    conformed = dict(data)
    for key, hint in typing.get_type_hints(shape).items():
        value = data.get(key)
        record = _record_in(hint)
        if record is not None and isinstance(value, dict):
            conformed[key] = _conformed(record, value)
        elif key in data and _fits(hint, value):
            continue
        elif key in required:
            conformed[key] = _default(hint)
        else:
            conformed.pop(key, None)
    return conformed


def _record_in(hint: object) -> type | None:
    """The TypedDict a hint names (alone or with None), if any."""
    for option in _options(hint):
        if typing.is_typeddict(option):
            return typing.cast(type, option)
    return None


def _options(hint: object) -> tuple[object, ...]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _fits(hint: object, value: object) -> bool:
    """The value is of the declared type (an int is a float; a bool is no number)."""
    for option in _options(hint):
        origin = typing.get_origin(option)
        if option is type(None) and value is None:
            return True
        if origin is Literal and value in typing.get_args(option):
            return True
        if origin is list and isinstance(value, list):
            (item,) = typing.get_args(option)
            if all(_fits(item, v) for v in value):
                return True
        if option is bool and isinstance(value, bool):
            return True
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if option is str and isinstance(value, str):
            return True
    return False


def _default(hint: object) -> JSON:
    """What a loop that never ran would show for a key of this type."""
    options = _options(hint)
    if type(None) in options:
        return None
    first = options[0]
    if typing.get_origin(first) is Literal:
        return typing.cast(JSON, typing.get_args(first)[0])
    if typing.get_origin(first) is list:
        return []
    if typing.is_typeddict(first):
        return _conformed(typing.cast(type, first), {})
    defaults: dict[object, JSON] = {bool: False, int: 0, float: 0.0, str: ""}
    return defaults[first]


def _corrupt(target: Path, why: str) -> FatalError:
    return FatalError(Problem(f"{why}; {_reset_hint(target)}", str(target)))


def _reset_hint(target: Path) -> str:
    return f"delete {target} to start over (its snapshot will be lost)"
