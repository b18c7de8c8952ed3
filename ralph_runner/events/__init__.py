"""The run's events: one frozen dataclass per kind, and their `--json` shape.

The loop, the service's death path, the pause and the fleet emit these (output.bus.EventBus);
the console, the history, the metrics textfile and the notifier follow them by class. Each
class knows its `--json` name (`NAME`) and its fields: the dataclass fields in order, one with
OMITTED metadata left out while it holds that value (users parse these lines: a name or a field
is never renamed). `host` is set on the events a fleet run hands on from a host's loop, last on
the line. `from_json` turns a line back into its event; a kind this ralph-run does not know (a
newer remote's) becomes an `Unknown` that carries its fields as they are.

By concern: base.py (Event, Unknown), loop.py, service.py, pause.py, fleet.py; every class is
imported from here (`from ralph_runner.events import Death`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ralph_runner.durable.json_value import JSON
from ralph_runner.events.base import (
    IF_FALSE,
    IF_NONE,
    IF_TRUE,
    OMITTED,
    Event,
    Unknown,
)
from ralph_runner.events.fleet import (
    Fleet,
    FleetSummary,
    HostDone,
    HostRow,
    HostSays,
)
from ralph_runner.events.loop import (
    AgentFoundBroken,
    Done,
    Governed,
    Interrupted,
    ItemSetAside,
    IterationEnded,
    IterationStarted,
    LimitedWait,
    LimitFacts,
    Outcome,
    Output,
    Resume,
    Retry,
    Skip,
    Step,
    StepDone,
    Strike,
    Summary,
    UsageLimitHit,
    Warned,
    Watch,
    WorkerConflict,
    WorkerLanded,
    WorkerRetry,
    WorkerStarted,
)
from ralph_runner.events.pause import (
    BlockStep,
    BlockSteps,
    Paused,
    PauseRequested,
    PauseStep,
    PauseSteps,
    Resumed,
    ResumeStep,
    ResumeSteps,
)
from ralph_runner.events.service import (
    Capture,
    Death,
    Receipt,
    Recorder,
    Recovery,
    RecoveryFailed,
    RecoveryStep,
    RecoveryWait,
    Rejuvenated,
    RejuvenationDue,
    Report,
    Start,
    Started,
)

__all__ = [
    "IF_FALSE",
    "IF_NONE",
    "IF_TRUE",
    "KINDS",
    "OMITTED",
    "AgentFoundBroken",
    "BlockStep",
    "BlockSteps",
    "Capture",
    "Death",
    "Done",
    "Event",
    "Fleet",
    "FleetSummary",
    "Governed",
    "HostDone",
    "HostRow",
    "HostSays",
    "Interrupted",
    "ItemSetAside",
    "IterationEnded",
    "IterationStarted",
    "LimitFacts",
    "LimitedWait",
    "Outcome",
    "Output",
    "PauseRequested",
    "PauseStep",
    "PauseSteps",
    "Paused",
    "Receipt",
    "Recorder",
    "Recovery",
    "RecoveryFailed",
    "RecoveryStep",
    "RecoveryWait",
    "Rejuvenated",
    "RejuvenationDue",
    "Report",
    "Resume",
    "ResumeStep",
    "ResumeSteps",
    "Resumed",
    "Retry",
    "Skip",
    "Start",
    "Started",
    "Step",
    "StepDone",
    "Strike",
    "Summary",
    "Unknown",
    "UsageLimitHit",
    "Warned",
    "Watch",
    "WorkerConflict",
    "WorkerLanded",
    "WorkerRetry",
    "WorkerStarted",
    "from_json",
    "masked",
]

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
