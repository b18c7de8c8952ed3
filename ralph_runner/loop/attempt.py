"""One attempt of `loop.workers` > 1 (loop/workers.py), and what its Iteration is handed.

`AttemptRun` is the attempt's side of iteration.Run and the LoopRuntime: its worktree as the
workdir, its own checklist and tree, its output, and the pool's shared parts (the service, the
usage-limit hold, the run's state)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ralph_runner import events
from ralph_runner.actions import TaskResult
from ralph_runner.loop import limit_hold, pause, proxy
from ralph_runner.loop.iteration import Iteration
from ralph_runner.process import output_text
from ralph_runner.workspace import checklist, git, worktrees

if TYPE_CHECKING:
    from ralph_runner.durable.redaction import Redactor
    from ralph_runner.liveness.health import Health
    from ralph_runner.liveness.service import Service
    from ralph_runner.loop.state import State
    from ralph_runner.output import EventBus
    from ralph_runner.process.signals import InterruptsRaise
    from ralph_runner.runbook.plan import Plan
    from ralph_runner.runbook.schema import Runbook


class Runner(Protocol):
    """What the workers need of the run (runner.Runner): its run-wide, shared parts."""

    plan: Plan
    model: Runbook
    bus: EventBus
    state: State
    stop: threading.Event
    redactor: Redactor
    checklist_path: Path
    housekeeping: Callable[[str, str], bool]
    proxy: proxy.Proxy | None
    health: Health
    service: Service
    signals: InterruptsRaise
    pause: pause.Pause

    def save(self, status_only: bool = False) -> None: ...
    def forget_counts(self) -> None: ...
    def checklist_counts(self) -> checklist.Counts: ...
    def summary(self, text: str, stopped: bool = False) -> None: ...


@dataclass
class Attempt:
    """One item's attempt by one worker: its worktree and how it ends."""

    worker: int
    item: checklist.Item
    strikable: bool  # every earlier item was settled when it started
    epoch: int  # the run's deaths when it started: a later death ended it
    restarts: int  # the servers the probes had seen restarted by then (Health.restarts)
    tree: worktrees.Tree | None = None
    phase: str | None = "starting"
    iteration: Iteration | None = None
    killed: threading.Event = field(default_factory=threading.Event)
    paused: bool = False  # `pause --now` killed it: no outcome, the item comes again
    step_cancel: threading.Event | None = None
    thread: threading.Thread | None = None


class Pool(Protocol):
    """What an attempt needs of its pool (loop/workers.Pool): the run, the usage-limit hold
    shared by every worker, and the one-at-a-time health check."""

    runner: Runner
    hold: limit_hold.Hold

    def ensure_service(
        self, attempt: Attempt, phase: str, context: dict[str, object] | None
    ) -> None: ...


class AttemptRun:
    """What an Iteration and the LOOP_ONLY actions need, for one attempt in its worktree."""

    def __init__(self, pool: Pool, attempt: Attempt, workdir: Path, checklist_path: Path) -> None:
        runner = pool.runner
        self.pool, self.attempt = pool, attempt
        self.plan, self.bus, self.state = runner.plan, runner.bus, runner.state
        self.stop, self.redactor = runner.stop, runner.redactor
        self.workdir, self.checklist_path = workdir, checklist_path
        self.in_repo = True
        self._lines = output_text.Lines()  # `-v`: a line over 64 KiB comes in cut pieces

    def show_output(self, text: str) -> None:
        """`-v`: the attempt's step output, a line at a time, escape codes left out."""
        for line in self._lines.feed(text):
            self.bus.emit(events.Output(step=self.attempt.phase, text=line))

    def flush_output(self) -> None:
        if (last := self._lines.end()) is not None:
            self.bus.emit(events.Output(step=self.attempt.phase, text=last))

    @property
    def limited_since(self) -> float | None:
        """The first of the limited attempts in a row, the pool's: the quota is shared."""
        return self.pool.hold.since

    @limited_since.setter
    def limited_since(self, value: float | None) -> None:
        self.pool.hold.since = value

    def save(self, status_only: bool = False) -> None:
        self.pool.runner.save(status_only)

    def forget_counts(self) -> None:
        self.pool.runner.forget_counts()

    def snapshot(self) -> git.Snapshot | None:
        return git.snapshot(self.workdir).without(self.pool.runner.housekeeping)

    @property
    def item_in_hand(self) -> str | None:
        return self.attempt.item.text

    @property
    def before(self) -> git.Snapshot | None:
        it = self.attempt.iteration
        return it.before if it else None

    def look_at_tree(self) -> git.Snapshot | None:
        it = self.attempt.iteration
        return it.look_at_tree() if it else self.snapshot()

    def ensure_alive(self, phase: str, context: dict[str, object]) -> TaskResult:
        started = time.monotonic()
        self.pool.ensure_service(self.attempt, phase, context)
        return TaskResult(ok=True, seconds=time.monotonic() - started)
