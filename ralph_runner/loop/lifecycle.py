"""The runbook's `setup:` and `teardown:` blocks: what the loop holds for its whole run.

`setup:` runs once when the run starts, before the first health check (e.g. acquire the GPU
from a scheduler); the loop's first check then starts the server if nothing listens, as ever
(a `start`, no death). `teardown:` runs once when the run ends, whatever the end: finished,
max_iterations, gave up, agent broken, limited, SIGTERM, SIGINT, an error in the runbook
(e.g. release the GPU, stop the server). Both are tasks as recovery steps are, run on the target
host through `tasks.run_steps`, the path of the pause and resume blocks too.

A failed setup ends the run as a recovery that gave up does (recovery.exit_code: the service
cannot be started without what setup acquires), and teardown still runs: setup may have got
half of it. A failed teardown is reported (an event, status.json) and the run's exit stays
what its end made it.

A kill -9 runs no teardown. So the marker `.ralph/held` is written durably once setup
succeeded and removed once teardown succeeded: the next run finding it says so (a warning,
status.json's `lifecycle.left_by_last_run`) before its setup acquires again. Setup steps should
therefore be idempotent (an acquire of what this job holds already succeeds), as the shipped
runbooks' are.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from ralph_runner import events
from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError, GaveUp

if TYPE_CHECKING:
    from ralph_runner.loop.state import Store
    from ralph_runner.output import EventBus
    from ralph_runner.process import execute
    from ralph_runner.runbook.loader import TaskSpec
    from ralph_runner.runbook.plan import Plan
    from ralph_runner.workspace.checklist import Counts
    from ralph_runner.workspace.status_file import Held, LifecycleStatus

MARKER = "held"  # .ralph/held: setup succeeded, teardown has not yet
BlockName = Literal["setup", "teardown"]
BlockState = Literal["running", "done", "failed"]


class Loop(Protocol):
    """What the blocks need of the loop (loop/runner.py's Runner)."""

    store: Store
    bus: EventBus
    plan: Plan
    signals: execute.InterruptsRaise
    stop: threading.Event

    def save(self, status_only: bool = False) -> None: ...
    def checklist_counts(self) -> Counts: ...
    def forget_counts(self) -> None: ...


def read_marker(path: Path) -> Held | None:
    """What the marker says of the run that wrote it; None when there is none. A marker that
    is not the JSON written here is still a marker: something was held."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        text = ""
    try:
        data = json.loads(text)
    except ValueError:
        data = {}
    data = data if isinstance(data, dict) else {}
    pid, since, host = data.get("pid"), data.get("since"), data.get("host")
    return {
        "pid": pid if isinstance(pid, int) else None,
        "since": float(since) if isinstance(since, int | float) else None,
        "host": host if isinstance(host, str) else None,
    }


class Lifecycle:
    """One run's setup and teardown: each runs at most once; teardown only after a setup
    began (a run refused before it, by its preflight or the workdir's lock, held nothing)."""

    def __init__(self, runner: Loop) -> None:
        self.runner = runner
        self.marker = runner.store.dir / MARKER
        self.setup_state: BlockState | None = None
        self.teardown_state: BlockState | None = None
        self.error: str | None = None  # the failed block's step and how it ended
        self.left: Held | None = None  # the marker a run killed before its teardown left
        self.began = False

    def setup(self) -> None:
        """The run's start: report a marker left behind, run `setup:`, write the marker.
        GaveUp (recovery.exit_code) when a setup step fails."""
        runner = self.runner
        self.began = True
        self.left = read_marker(self.marker)
        if self.left is not None:
            runner.bus.warn(self._left_text(self.left))
            runner.save(status_only=True)
        specs = runner.plan.runbook.setup_steps
        if not specs:
            return
        error = self._block("setup", specs, runner.stop)
        if error is not None:
            exit_code = runner.plan.model.recovery.exit_code
            raise GaveUp(f"setup failed: {error}", exit_code=exit_code)
        since = round(time.time(), 3)
        held = {"pid": os.getpid(), "since": since, "host": socket.gethostname()}
        try:
            write_atomic(self.marker, (json.dumps(held) + "\n").encode("utf-8"))
        except FatalError as exc:  # the run goes on; only a kill -9 would go unreported
            runner.bus.warn(f"what setup holds is not marked: {exc}")

    def teardown(self) -> None:
        """The run's end, once, whatever the end; never raises (the run's own end wins)."""
        if not self.began or self.teardown_state is not None:
            return
        specs = self.runner.plan.runbook.teardown_steps
        if not specs:
            self.marker.unlink(missing_ok=True)  # setup alone: nothing left to release
            return
        # Its own cancel: the run's stop is set by the SIGTERM that may be ending it.
        if self._block("teardown", specs, threading.Event()) is None:
            self.marker.unlink(missing_ok=True)

    def _block(
        self, which: BlockName, specs: list[TaskSpec], cancel: threading.Event
    ) -> str | None:
        """Run one block through the recovery steps' path; its failure, or None."""
        from ralph_runner.runbook import tasks

        runner = self.runner
        self._set(which, "running")
        runner.save(status_only=True)
        started = time.monotonic()
        ran = 0

        def starting(spec: TaskSpec, skipped: str | None) -> None:
            nonlocal ran
            ran += skipped is None
            runner.bus.emit(events.BlockStep(block=which, step=spec.name, skipped=skipped))

        error = tasks.run_steps(
            specs,
            tasks.TaskGroup(runner.plan),
            self._variables(which),
            cancel,
            starting,
            # setup: a signal ends it at a step boundary; teardown: a signal is what ends the
            # run, and the second one is ignored until the run is saved (process/signals.py)
            between=runner.signals.raise_pending if which == "setup" else lambda: None,
            template_errors_end=True,
        ).failure
        self._set(which, "failed" if error else "done")
        self.error = error or self.error
        runner.forget_counts()
        runner.bus.emit(
            events.BlockSteps(
                block=which,
                ok=error is None,
                ran=ran,
                seconds=round(time.monotonic() - started, 3),
                error=error,
            )
        )
        runner.save(status_only=True)
        return error

    def _set(self, which: BlockName, state: BlockState) -> None:
        if which == "setup":
            self.setup_state = state
        else:
            self.teardown_state = state

    def _variables(self, which: BlockName) -> dict[str, object]:
        """What the blocks' templates see: the runbook's variables, the checklist's counts and
        the block's name as `phase`; no `item`, no `death`."""
        runner = self.runner
        return {
            **runner.plan.variables,
            "checklist": runner.checklist_counts().as_dict(),
            "phase": which,
        }

    @staticmethod
    def _left_text(left: Held) -> str:
        who = f"pid {left['pid']}" if left["pid"] is not None else "a run"
        when = (
            time.strftime(" (setup at %H:%M:%S)", time.localtime(left["since"]))
            if left["since"]
            else ""
        )
        return (
            f"the last run here ({who}{when}) ended without its teardown (killed?): what its "
            "setup acquired may still be held; setup runs again now"
        )

    def fields(self) -> LifecycleStatus | None:
        """status.json's `lifecycle`: None for a runbook without the blocks and nothing left."""
        book = self.runner.plan.runbook
        if not (book.setup_steps or book.teardown_steps or self.left):
            return None
        return {
            "setup": self.setup_state,
            "teardown": self.teardown_state,
            "error": self.error,
            "held": self.marker.exists() if self.began else False,
            "left_by_last_run": self.left,
        }
