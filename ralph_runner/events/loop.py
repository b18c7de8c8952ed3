"""The loop's events: iterations, steps, items, usage limits, workers, the summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypedDict

from ralph_runner.events.base import IF_FALSE, IF_NONE, OMITTED, Event

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
