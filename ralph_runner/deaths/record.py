"""The records of a death log's JSONL twin, their shape declared once.

liveness/service.py builds them, deaths/log.py writes them and reads them back, and the tables,
signatures and report read their keys. A record read back may come from an older ralph-run or a
hand, so every key is optional (`total=False`) and readers `.get()` them; the keys and their
order are the on-disk format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict, TypeGuard

from ralph_runner.durable.json_value import JSONObject

if TYPE_CHECKING:  # the probes package imports every probe kind: not for reading records
    from ralph_runner.probes import ProbeEntry


class ItemEntry(TypedDict, total=False):
    """The checklist item in hand (the loop's `item` variable)."""

    text: str
    line: int
    index: int
    attempts: int
    deaths: int  # deaths in a row with it alone in flight (loop/blame.py)


class StepEntry(TypedDict, total=False):
    """The iteration's failed or killed loop step (loop/runner.py)."""

    name: str
    status: str
    exit_code: int | None
    timed_out: bool
    killed: bool
    stalled: bool
    output_tail: str
    reason: str
    from_process: bool


class CollectorEntry(TypedDict, total=False):
    """One collector's capture at a death (liveness/diagnostics.py)."""

    name: str
    ok: bool
    exit_code: int | None
    timed_out: bool
    truncated: bool
    cut_bytes: int
    seconds: float
    skipped: bool  # its `when:` was false
    output: str


class RecoveryStep(TypedDict, total=False):
    """One recovery step of one attempt (liveness/recovery.py)."""

    attempt: int
    name: str
    ok: bool
    skipped: bool
    exit_code: int | None
    timed_out: bool
    seconds: float
    output: str


class SignatureFrom(TypedDict):
    source: str | None  # "recorder log", a collector's name, "probes"
    line: str | None  # the exception line as the log had it


class Known(TypedDict, total=False):
    """What the loop knows at a death, recorded with it (Runner._facts)."""

    iteration: int
    item: ItemEntry | None
    step: StepEntry
    prompt_size: int | None
    prompt_bytes: int | None
    checklist: dict[str, int]
    context: JSONObject  # an ensure_alive step's own facts


class Facts(Known, total=False):
    """Known, and the iteration's variables: the recovery steps', never the record's."""

    variables: dict[str, object]  # template variables: any Python value


class DuringRecovery(TypedDict, total=False):
    """The loop whose recovery was under way when this death was found: its own record
    (`records`, death number `death`) holds the diagnostics of the moment of death."""

    by: str
    records: str
    death: int


class Blame(TypedDict):
    """Which items were in flight at a death (their prompts sent), and whether it counts
    against one of them (loop/blame.py): `item` when it was alone, with its `deaths` in a row;
    `set_aside` when that makes it the cause."""

    in_flight: list[str]
    item: str | None
    deaths: int
    set_aside: bool


class DeathRecord(TypedDict, total=False):
    """`event: death` (or `diagnose`: the same capture on request, never written)."""

    event: str
    death: int
    time: str
    host: str
    runbook: str
    service: str
    iteration: int | None
    item: ItemEntry | None
    step: StepEntry
    prompt_size: int | None
    prompt_bytes: int | None
    checklist: dict[str, int]
    context: JSONObject
    phase: str
    fault: str
    evidence: str
    probes: list[ProbeEntry]
    probe_rounds: int
    collectors: list[CollectorEntry]
    capture_seconds: float
    during_recovery: DuringRecovery  # captured while another loop recovered the service
    recorder: JSONObject  # the flight recorder's window (deaths/recorder.py)
    signature: str
    signature_from: SignatureFrom
    blame: Blame  # the items in flight (a death with none has no blame)


class Outcome(TypedDict, total=False):
    """How a recovery (or a start) ended: liveness/recovery.Outcome as recorded."""

    attempts: int
    recovered: bool
    seconds: float
    reason: str | None
    steps: list[RecoveryStep]
    by: str  # healthy again with no step of ours: who brought it back


class RecoveryRecord(Outcome, total=False):
    """`event: recovery`: the outcome of death number `death`."""

    event: str
    death: int
    time: str


class StartRecord(Outcome, total=False):
    """`event: start`: the service was not running at the run's first check (no death)."""

    event: str
    time: str
    host: str
    runbook: str
    service: str
    probes: list[ProbeEntry]


class RejuvenationRecord(Outcome, total=False):
    """`event: rejuvenation`: a server that rotted, restarted at an item boundary (no death):
    the signs, the numbers before (and the baseline they were measured against)."""

    event: str
    rejuvenation: int
    time: str
    host: str
    service: str
    signs: list[str]
    found: str  # what the signs found, in words
    before: dict[str, float | None]
    baseline: dict[str, float | None]
    pid_before: int | None
    pid_after: int | None


class RejuvenationAfter(TypedDict, total=False):
    """`event: rejuvenation-after`: the restarted server's own baseline, once measured."""

    event: str
    rejuvenation: int
    time: str
    after: dict[str, float | None]


Record = DeathRecord | RecoveryRecord | StartRecord | RejuvenationRecord | RejuvenationAfter


def is_death(entry: Mapping[str, object]) -> TypeGuard[DeathRecord]:
    return entry.get("event") == "death"


def is_recovery(entry: Mapping[str, object]) -> TypeGuard[RecoveryRecord]:
    return entry.get("event") == "recovery"
