"""The service's events: a death, its capture and report, a start, a recovery; the records."""

from __future__ import annotations

from dataclasses import dataclass, field

from ralph_runner.events.base import IF_NONE, IF_TRUE, Event

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


# -- rejuvenation (health.rejuvenate, loop/rejuvenation.py) -----------------------------------


@dataclass(frozen=True, kw_only=True)
class RejuvenationDue(Event):
    """A server that rots: a restart is due at the next item boundary (no attempt is started
    until it is over; those in flight land first)."""

    NAME = "rejuvenation-due"
    signs: list[str]
    reason: str
    in_flight: list[str]  # the items of the attempts that land before the restart


@dataclass(frozen=True, kw_only=True)
class Rejuvenated(Event):
    """The restart at the boundary: no death, no strike; its numbers before and after."""

    NAME = "rejuvenated"
    rejuvenation: int  # this workdir's count
    signs: list[str]
    reason: str
    recovered: bool
    seconds: float
    before: dict[str, float | None]  # the numbers that triggered it (signs.Reading's)
    baseline: dict[str, float | None]  # the server's baseline since its start
    pid_before: int | None = field(default=None, metadata=IF_NONE)
    pid_after: int | None = field(default=None, metadata=IF_NONE)
    error: str | None = field(default=None, metadata=IF_NONE)
