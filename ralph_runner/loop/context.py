"""The run as its parts see it: one `RunContext`, made once by the Runner (runner.py) when the
service exists, and handed down to the scheduler, the attempts, their iterations and the named
blocks. One object, not an interface per reader: what a part may change is said where it does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ralph_runner.workspace import checklist, git

if TYPE_CHECKING:
    from ralph_runner.durable.redaction import Redactor
    from ralph_runner.liveness.health import Health
    from ralph_runner.liveness.service import Service
    from ralph_runner.loop.blame import Blame
    from ralph_runner.loop.proxy import Proxy
    from ralph_runner.loop.state import State, Store
    from ralph_runner.output.bus import EventBus
    from ralph_runner.process.signals import InterruptsRaise
    from ralph_runner.runbook.plan import Plan
    from ralph_runner.runbook.schema import Runbook


@dataclass
class ChecklistCounts:
    """The checklist's counts for status.json, variables and death records: read again only
    after something that can change the file ran (a process step, a recovery, a skip, a block).
    """

    path: Path
    _counts: checklist.Counts | None = None
    last: checklist.Counts | None = None  # the last read, for a status when the file goes bad
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self) -> checklist.Counts:
        with self._lock:
            if self._counts is None:
                self._counts = checklist.counts(checklist.read(self.path))
            self.last = self._counts
            return self._counts

    def take(self, counts: checklist.Counts) -> None:
        """Counts the scheduler read with the checklist's text: no second read."""
        with self._lock:
            self._counts = self.last = counts

    def forget(self) -> None:
        with self._lock:
            self._counts = None


@dataclass
class RunContext:
    """The run-wide parts an attempt, an iteration or a block uses. `save` persists the state
    and status.json, `save_status` status.json alone (the state has not moved): both warn on a
    full disk and go on. The state and the counts are shared by every worker's thread: the
    scheduler's lock guards what is read and written together."""

    plan: Plan
    bus: EventBus
    state: State
    store: Store
    stop: threading.Event
    signals: InterruptsRaise
    redactor: Redactor
    counts: ChecklistCounts
    in_repo: bool
    housekeeping: Callable[[str, str], bool]  # an agent's own files, left out of snapshots
    proxy: Proxy | None
    health: Health
    service: Service
    save: Callable[[], None]
    save_status: Callable[[], None]
    blame: Blame  # deaths an item causes (loop/blame.py), over the state's counts
    # The state's counters and the checklist, read and written together by workers' threads
    # (the scheduler waits on it); held for moments, never over a step or a landing.
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def model(self) -> Runbook:
        return self.plan.model

    @property
    def checklist_path(self) -> Path:
        return self.counts.path

    def snapshot(self, workdir: Path) -> git.Snapshot | None:
        """HEAD and the changed paths of `workdir`, agent housekeeping left out; None outside a
        repository."""
        if not self.in_repo:
            return None
        return git.snapshot(workdir).without(self.housekeeping)
