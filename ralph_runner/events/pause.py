"""The pause's events, and the run's setup and teardown blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ralph_runner.events.base import IF_NONE, Event

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
