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
from typing import TYPE_CHECKING

from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError, GaveUp
from ralph_runner.loop.blocks import BlockRun, run_block

if TYPE_CHECKING:
    from ralph_runner.loop.context import RunContext
    from ralph_runner.workspace.status_file import Held, LifecycleStatus

MARKER = "held"  # .ralph/held: setup succeeded, teardown has not yet


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

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.marker = run.store.dir / MARKER
        self.setup_block: BlockRun | None = None
        self.teardown_block: BlockRun | None = None
        self.left: Held | None = None  # the marker a run killed before its teardown left
        self.began = False

    def setup(self) -> None:
        """The run's start: report a marker left behind, run `setup:`, write the marker.
        GaveUp (recovery.exit_code) when a setup step fails."""
        run = self.run
        self.began = True
        self.left = read_marker(self.marker)
        if self.left is not None:
            run.bus.warn(self._left_text(self.left))
            run.save_status()
        specs = run.plan.runbook.setup_steps
        if not specs:
            return
        error = self._block("setup", run.stop).error
        if error is not None:
            raise GaveUp(f"setup failed: {error}", exit_code=run.model.recovery.exit_code)
        since = round(time.time(), 3)
        held = {"pid": os.getpid(), "since": since, "host": socket.gethostname()}
        try:
            write_atomic(self.marker, (json.dumps(held) + "\n").encode("utf-8"))
        except FatalError as exc:  # the run goes on; only a kill -9 would go unreported
            run.bus.warn(f"what setup holds is not marked: {exc}")

    def teardown(self) -> None:
        """The run's end, once, whatever the end; never raises (the run's own end wins)."""
        if not self.began or self.teardown_block is not None:
            return
        if not self.run.plan.runbook.teardown_steps:
            self.marker.unlink(missing_ok=True)  # setup alone: nothing left to release
            return
        # Its own cancel: the run's stop is set by the SIGTERM that may be ending it.
        if self._block("teardown", threading.Event(), held=self._may_hold()).error is None:
            self.marker.unlink(missing_ok=True)

    def _may_hold(self) -> bool:
        """Whether anything may be held at teardown: a setup step that succeeded, a marker
        the last run left, or no setup at all (what teardown releases is then not ours to know)."""
        setup = self.setup_block
        return setup is None or setup.completed > 0 or self.left is not None

    def _block(self, which: str, cancel: threading.Event, held: bool | None = None) -> BlockRun:
        book, run = self.run.plan.runbook, self.run

        def shown(block: BlockRun) -> None:
            if which == "setup":
                self.setup_block = block
            else:
                self.teardown_block = block

        return run_block(
            run,
            "setup" if which == "setup" else "teardown",
            book.setup_steps if which == "setup" else book.teardown_steps,
            cancel=cancel,
            # setup: a signal ends it at a step boundary; teardown: a signal is what ends the
            # run, and the second one is ignored until the run is saved (process/signals.py)
            between=run.signals.raise_pending if which == "setup" else lambda: None,
            shown=shown,
            held=held,
        )

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
        book = self.run.plan.runbook
        if not (book.setup_steps or book.teardown_steps or self.left):
            return None
        failed = [b.error for b in (self.setup_block, self.teardown_block) if b and b.error]
        return {
            "setup": self.setup_block.state if self.setup_block else None,
            "teardown": self.teardown_block.state if self.teardown_block else None,
            "error": failed[-1] if failed else None,
            "held": self.marker.exists() if self.began else False,
            "left_by_last_run": self.left,
        }
