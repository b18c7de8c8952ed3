"""The run's events: one frozen dataclass per kind, and their `--json` shape.

The loop, the service's death path, the pause and the fleet emit these (output.bus.EventBus);
the console, the history, the metrics textfile and the notifier follow them by class. Each
class knows its `--json` name (`NAME`) and its fields: the dataclass fields in order, one with
OMITTED metadata left out while it holds that value (users parse these lines: a name or a field
is never renamed). `host` is set on the events a fleet run hands on from a host's loop, last on
the line. `from_json` turns a line back into its event; a kind this ralph-run does not know (a
newer remote's) becomes an `Unknown` that carries its fields as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypedDict

from ralph_runner.durable.json_value import JSON

OMITTED = "omitted"  # a field's metadata: the value for which --json leaves the field out
IF_NONE = {OMITTED: None}  # field(default=None, metadata=IF_NONE): left out while None
IF_FALSE = {OMITTED: False}  # ... a flag said only when it is set
IF_TRUE = {OMITTED: True}  # ... a flag said only when it is not


@dataclass(frozen=True, kw_only=True)
class Event:
    """One thing that happened; `kind` is its --json name."""

    NAME: ClassVar[str] = ""
    # the host whose loop said it (a fleet run's); None: this one
    host: str | None = field(default=None, metadata=IF_NONE)

    @property
    def kind(self) -> str:
        return self.NAME

    def json_fields(self) -> dict[str, object]:
        """The fields of its --json line (beside `event` and `time`), in order."""
        found: dict[str, object] = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if spec.name == "host" or (
                OMITTED in spec.metadata and value is spec.metadata[OMITTED]
            ):
                continue
            found[spec.name] = value
        if self.host is not None:
            found["host"] = self.host
        return found


@dataclass(frozen=True, kw_only=True)
class Unknown(Event):
    """An event of a kind this ralph-run does not know (a newer remote's), passed on as is."""

    name: str
    fields: dict[str, JSON]

    @property
    def kind(self) -> str:
        return self.name

    def json_fields(self) -> dict[str, object]:
        return {**self.fields, **({"host": self.host} if self.host is not None else {})}


# -- the loop --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Resume(Event):
    NAME = "resume"
    iteration: int
    deaths: int
    item: str | None


@dataclass(frozen=True, kw_only=True)
class IterationStarted(Event):
    NAME = "iteration"
    iteration: int
    item: str
    attempts: int  # the item's strikes so far
    done: int
    todo: int
    skipped: int
    deaths: int
    prompt_size: int  # characters
    prompt_bytes: int


@dataclass(frozen=True, kw_only=True)
class Step(Event):
    NAME = "step"
    step: str
    action: str  # the action kind
    worker: int | None = field(default=None, metadata=IF_NONE)  # loop.workers > 1: whose


@dataclass(frozen=True, kw_only=True)
class StepDone(Event):
    NAME = "step-done"
    step: str
    ok: bool
    exit_code: int | None
    timed_out: bool
    killed: bool  # by the watch: the service died
    # idle_timeout's verdict; only a stalled step says it
    stalled: bool = field(default=False, metadata=IF_FALSE)
    status: str  # "ok", or how it failed in words
    seconds: float
    worker: int | None = field(default=None, metadata=IF_NONE)  # loop.workers > 1: whose


@dataclass(frozen=True, kw_only=True)
class Watch(Event):
    """The service died while a step ran: the step was killed."""

    NAME = "watch"
    step: str
    killed: bool


@dataclass(frozen=True, kw_only=True)
class Output(Event):
    """`-v`: a line of a step's output."""

    NAME = "output"
    step: str | None
    text: str


@dataclass(frozen=True, kw_only=True)
class Done(Event):
    NAME = "done"
    item: str


@dataclass(frozen=True, kw_only=True)
class Retry(Event):
    """The service died during the attempt: the item again, no strike."""

    NAME = "retry"
    item: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Strike(Event):
    NAME = "strike"
    item: str
    strikes: int
    of: int
    reason: str
    output_tail: str


@dataclass(frozen=True, kw_only=True)
class Skip(Event):
    NAME = "skip"
    item: str
    strikes: int


@dataclass(frozen=True, kw_only=True)
class ItemSetAside(Event):
    """The cause of `deaths` deaths in a row (loop/blame.py): `- [!]`, and the run goes on."""

    NAME = "item-set-aside"
    item: str
    deaths: int
    signature: str | None  # its deaths' most common signature
    prompt_size: int  # its prompt's characters, the last time it was sent
    reason: str


@dataclass(frozen=True, kw_only=True)
class AgentFoundBroken(Event):
    NAME = "agent-broken"
    item: str
    previous_item: str
    reason: str
    output_tail: str
    skipped: list[str]
    exit_code: int


@dataclass(frozen=True, kw_only=True)
class UsageLimitHit(Event):
    """A usage limit in the agent's output: waited out, or the end of the run (`exit_code`)."""

    NAME = "limited"
    item: str
    source: str
    line: str
    reset_at: float | None
    until: float
    reset: str  # reset_at in words
    seconds: float  # the wait
    guessed: bool  # no reset time given
    ends_run: bool
    exit_code: int | None = field(default=None, metadata=IF_NONE)  # only when it ends the run


@dataclass(frozen=True, kw_only=True)
class LimitedWait(Event):
    NAME = "limited-wait"
    item: str
    seconds: float
    until: str


class LimitFacts(TypedDict):
    """What an iteration that met a usage limit says of it."""

    source: str
    seconds: float
    reset: str


Outcome = Literal[
    "done", "death", "strike", "skipped", "set-aside", "limited", "paused", "unknown", "conflict",
    "deferred", "gave-up", "interrupted", "failed",
]  # fmt: skip
"""How an iteration ended; the last three: the run ended inside it, and how. With workers:
`conflict` (its landing conflicted: retried on the new head) and `deferred` (it failed while an
earlier item was unsettled: retried once they are, no strike)."""


@dataclass(frozen=True, kw_only=True)
class IterationEnded(Event):
    """Said by the loop when an iteration ends, with its outcome: what the history writes."""

    NAME = "iteration-ended"
    iteration: int
    item: str
    outcome: Outcome
    reason: str | None = field(default=None, metadata=IF_NONE)  # a death's retry or a strike: why
    # a strike (or the skip after it): the item's strikes
    strikes: int | None = field(default=None, metadata=IF_NONE)
    # a usage limit: which, the wait, the reset
    limit: LimitFacts | None = field(default=None, metadata=IF_NONE)


# -- workers (loop.workers > 1, loop/landing.py) ---------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WorkerStarted(Event):
    """A worker took an item: its worktree and branch, and whether a failure would strike."""

    NAME = "worker-started"
    worker: int
    iteration: int
    item: str
    branch: str
    base: str  # the workdir's head it branched from
    strikable: bool  # every earlier item was settled when it started


@dataclass(frozen=True, kw_only=True)
class WorkerLanded(Event):
    """An attempt's commits replayed onto the workdir's branch, its item ticked there."""

    NAME = "worker-landed"
    worker: int
    item: str
    commits: int  # the attempt's commits replayed (the checklist left out), the tick not counted
    head: str  # the workdir's new head


@dataclass(frozen=True, kw_only=True)
class WorkerConflict(Event):
    """A verified attempt did not apply on the new head: retried there, no strike (until `of`)."""

    NAME = "worker-conflict"
    worker: int
    item: str
    conflicts: int  # the item's conflicting landings so far
    of: int  # the conflicts retried before one counts as a failure
    reason: str


@dataclass(frozen=True, kw_only=True)
class WorkerRetry(Event):
    """An attempt that costs no strike: a death ended it, or an earlier item was unsettled."""

    NAME = "worker-retry"
    worker: int
    item: str
    reason: str
    waits: bool  # it waits for the earlier items to settle before it runs again


@dataclass(frozen=True, kw_only=True)
class Governed(Event):
    """`workers: auto` changed how many workers may be in flight, and why (loop/governor.py)."""

    NAME = "governor"
    workers: int  # admitted now
    was: int
    of: int  # max_workers
    reason: str


@dataclass(frozen=True, kw_only=True)
class Interrupted(Event):
    NAME = "interrupted"
    signal: str
    exit_code: int


@dataclass(frozen=True, kw_only=True)
class Summary(Event):
    NAME = "summary"
    stopped_at_max: bool
    iterations: int  # this run's
    done: int
    todo: int
    skipped: int
    deaths: int
    signatures: dict[str, int]  # this run's deaths by signature, most common first
    seconds: float
    set_aside: int = field(default=0, metadata={OMITTED: 0})  # items its deaths set aside
    # checklist lines that look like items but are not (never worked on)
    malformed: int = field(default=0, metadata={OMITTED: 0})


@dataclass(frozen=True, kw_only=True)
class Warned(Event):
    NAME = "warning"
    message: str


# -- the service -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Death(Event):
    NAME = "death"
    death: int
    phase: str
    reason: str
    fault: str


@dataclass(frozen=True, kw_only=True)
class Capture(Event):
    NAME = "capture"
    collectors: int
    # another loop that recovers it now
    during_recovery: str | None = field(default=None, metadata=IF_NONE)


@dataclass(frozen=True, kw_only=True)
class Report(Event):
    NAME = "report"
    death: int
    log: str
    signature: str | None
    written: bool = field(default=True, metadata=IF_TRUE)  # False: its record went to stderr
    error: str | None = field(default=None, metadata=IF_NONE)


@dataclass(frozen=True, kw_only=True)
class Start(Event):
    """Nothing listened at the run's first check: the service is started, no death."""

    NAME = "start"
    service: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Started(Event):
    NAME = "started"
    recovered: bool
    seconds: float
    attempts: int
    reason: str | None
    by: str | None


@dataclass(frozen=True, kw_only=True)
class RecoveryWait(Event):
    NAME = "recovery-wait"
    by: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class RecoveryStep(Event):
    NAME = "recovery-step"
    attempt: int
    step: str
    skipped: str | None = field(default=None, metadata=IF_NONE)  # why its `when:` skipped it


@dataclass(frozen=True, kw_only=True)
class RecoveryFailed(Event):
    NAME = "recovery-failed"
    attempt: int
    reason: str
    retry_in: float | None  # None after the last attempt


@dataclass(frozen=True, kw_only=True)
class Recovery(Event):
    NAME = "recovery"
    death: int
    recovered: bool
    attempts: int
    seconds: float
    reason: str | None
    by: str | None


# -- the records -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Recorder(Event):
    NAME = "recorder"
    message: str


@dataclass(frozen=True, kw_only=True)
class Receipt(Event):
    """What an iteration's own requests cost (the agent proxy's counts)."""

    NAME = "receipt"
    iteration: int
    item: str
    requests: int
    request_errors: int
    prompt_tokens: int
    generated_tokens: int
    tokens_estimated: bool
    first_token_seconds: float | None
    generation_seconds: float
    request_seconds: float


# -- the pause -------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PauseRequested(Event):
    NAME = "pause-requested"
    now: bool
    by: str | None


@dataclass(frozen=True, kw_only=True)
class Paused(Event):
    NAME = "paused"
    iteration: int
    item: str | None
    now: bool
    killed: str | None  # the step --now stopped
    by: str | None


@dataclass(frozen=True, kw_only=True)
class Resumed(Event):
    NAME = "resumed"
    iteration: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class PauseStep(Event):
    NAME = "pause-step"
    step: str
    skipped: str | None = field(default=None, metadata=IF_NONE)


@dataclass(frozen=True, kw_only=True)
class ResumeStep(Event):
    NAME = "resume-step"
    step: str
    skipped: str | None = field(default=None, metadata=IF_NONE)


@dataclass(frozen=True, kw_only=True)
class PauseSteps(Event):
    NAME = "pause-steps"
    ok: bool
    ran: int
    seconds: float
    error: str | None


@dataclass(frozen=True, kw_only=True)
class ResumeSteps(Event):
    NAME = "resume-steps"
    ok: bool
    ran: int
    seconds: float
    error: str | None


# -- the run's setup and teardown (loop/lifecycle.py) ---------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BlockStep(Event):
    NAME = "block-step"
    block: Literal["setup", "teardown"]
    step: str
    skipped: str | None = field(default=None, metadata=IF_NONE)  # why its `when:` skipped it


@dataclass(frozen=True, kw_only=True)
class BlockSteps(Event):
    NAME = "block-steps"
    block: Literal["setup", "teardown"]
    ok: bool
    ran: int
    seconds: float
    error: str | None
    # teardown's: whether setup may hold something (a step of it succeeded, or the last run's
    # marker); a failed teardown after a setup that acquired nothing says so
    held: bool | None = field(default=None, metadata=IF_NONE)


# -- the fleet -------------------------------------------------------------------------------------


class HostRow(TypedDict):
    """One host's line at the fleet's end."""

    host: str
    done: int | None
    todo: int | None
    skipped: int | None
    deaths: int
    exit_code: int | None


@dataclass(frozen=True, kw_only=True)
class Fleet(Event):
    NAME = "fleet"
    hosts: list[str]
    forks: int


@dataclass(frozen=True, kw_only=True)
class HostDone(Event):
    NAME = "host-done"
    host: str | None
    exit_code: int | None


@dataclass(frozen=True, kw_only=True)
class HostSays(Event):
    """A host's line that is no event (an error on its stderr)."""

    NAME = "host-says"
    host: str | None
    text: str


@dataclass(frozen=True, kw_only=True)
class FleetSummary(Event):
    NAME = "fleet-summary"
    hosts: list[HostRow]
    exit_code: int


KINDS: dict[str, type[Event]] = {
    kind.NAME: kind for kind in Event.__subclasses__() if kind is not Unknown
}
"""Every event class by its --json name."""


def from_json(line: Mapping[str, JSON]) -> Event:
    """The event of one --json line (its `event` and `time` dropped). A kind or a field this
    ralph-run does not know comes back as an `Unknown` with the line's fields, never an error."""
    fields = {key: value for key, value in line.items() if key not in ("event", "time")}
    name = str(line.get("event"))
    kind = KINDS.get(name)
    if kind is not None:
        given: Mapping[str, Any] = fields
        try:
            return kind(**given)
        except TypeError:  # a field it does not have, or one it lacks: a newer or older loop's
            pass
    host = fields.pop("host", None)
    return Unknown(name=name, fields=fields, host=host if isinstance(host, str) else None)


def masked(event: Event, mask: Mapping[str, object]) -> Event:
    """`event` with its fields replaced by `mask`'s (the redactor's copy of them)."""
    given: Mapping[str, Any] = {k: v for k, v in mask.items() if k != "host"}
    if isinstance(event, Unknown):
        return dataclasses.replace(event, fields=dict(given))
    return dataclasses.replace(event, **given)
