"""`ralph-run pause` / `resume`: a running loop held at its iteration boundary, and let go.

The request is a control file, `.ralph/pause` (JSON: when it was asked, `now`, by whom),
written atomically by `ralph-run pause` (locally, or over the host's connection with `-i`) and
removed by `ralph-run resume`. The scheduler (scheduler.py) looks at the file at each of its
rounds: with attempts in flight it says the request once (status.json: "pausing") and starts
nothing more; once none is in flight it holds the run (`Pause.hold`). While the file is there the
loop waits,
polling it every POLL s on the loop's stop event (SIGTERM and SIGINT interrupt the wait as
they interrupt a step), with `paused` in status.json and the phase `paused`; when the file goes,
it reads the checklist again (it may have been edited meanwhile) and goes on.

A pause asked for during an iteration lets the step in hand finish, and the rest of the
iteration (verify, its health checks) too: the item is settled as usual. `--now` stops the
running agent step of each attempt instead, the way a death does (its process tree, TERM then
KILL), and ends the iteration there, before anything counts it: no strike, no retry, the item
stays `- [ ]` and is the next one taken after `resume`. A file left behind (the loop
ended, or was stopped, while paused) holds the next run before its first iteration.

The runbook's `pause:` block runs once when the wait begins (e.g. stop the server: a paused
loop then holds no GPU), its `resume:` block once when the file goes, before the next
iteration; both are tasks as recovery steps are, run on the target host (a failing one ends its
block unless `ignore_errors`). A failed pause block leaves the loop paused, the failure an event
and in status.json: no death, no strike. After either block ran, the service is checked at
resume (not at the next iteration, where a new server's restart would read as someone else's
during the attempt), and a server the pause block stopped is *not running*, not dead: nothing
listening is started by the recovery steps and recorded as a `start`, as at a run's first check;
any other failure is a death as usual. A failed resume block is reported and the loop goes on
to that check.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

from ralph_runner import events
from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError, Problem
from ralph_runner.loop.blocks import BlockRun, run_block
from ralph_runner.workspace.state_files import STATE_DIR

if TYPE_CHECKING:
    from ralph_runner.loop.context import RunContext
    from ralph_runner.workspace.status_file import Pause as PauseStatus
    from ralph_runner.workspace.status_file import PauseFields

CONTROL = "pause"  # .ralph/pause
POLL = 0.5  # seconds between looks at the control file
PHASE = "paused"  # the loop's phase while it waits
RESUMING = "resuming"  # ... while the `resume:` block and the check after it run
CHECK_PHASE = "resume"  # the phase of the service check at resume (a death's `phase`)
NOT_PAUSED: PauseFields = {"paused": False, "pause": None, "step_started": None, "attempts": 0}


class Request(TypedDict, total=False):
    """The control file's request: when it was asked, whether `--now`, by whom."""

    requested: float
    now: bool
    by: str


def control_path(workdir: Path) -> Path:
    return Path(workdir) / STATE_DIR / CONTROL


def request_text(now: bool) -> str:
    """The control file's content: one JSON object."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    by = f"{user}@{socket.gethostname()}"
    return json.dumps({"requested": round(time.time(), 3), "now": now, "by": by}) + "\n"


def request(workdir: Path, now: bool = False) -> Path:
    """Ask the loop of `workdir` to pause (replacing an earlier request, e.g. to add --now)."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise FatalError(Problem("no such workdir", str(workdir)))
    path = control_path(workdir)
    try:
        path.parent.mkdir(exist_ok=True)
    except OSError as e:
        raise FatalError(Problem(f"cannot create: {e.strerror}", str(path.parent))) from None
    write_atomic(path, request_text(now).encode("utf-8"))
    return path


def release(workdir: Path) -> bool:
    """Let the loop of `workdir` go on; False when no pause was asked for."""
    if not Path(workdir).is_dir():  # as `request` says: not "not paused" (exit 0)
        raise FatalError(Problem("no such workdir", str(workdir)))
    try:
        control_path(workdir).unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        path = str(control_path(workdir))
        raise FatalError(Problem(f"cannot remove: {e.strerror}", path)) from None
    return True


def read(path: Path) -> Request | None:
    """The request in the control file, or None when there is none. A file that is not the JSON
    `pause` writes (a `touch .ralph/pause` by hand) is a plain pause."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return {"now": False}
    try:
        data = json.loads(text)
    except ValueError:
        return {"now": False}
    if not isinstance(data, dict):
        return {"now": False}
    request: Request = {"now": bool(data.get("now"))}
    if isinstance(requested := data.get("requested"), int | float):
        request["requested"] = float(requested)
    if isinstance(by := data.get("by"), str):
        request["by"] = by
    return request


class Pause:
    """One run's pause: the request seen during attempts, the wait at the boundary, the step
    in hand for status.json (a follower of the run's events, for its start time alone)."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.path = control_path(run.store.workdir)
        self.step_started: float | None = None  # epoch of the last `step` event
        self.requested: Request | None = None  # a request seen during an iteration
        self.since: float | None = None  # epoch when the wait began; None when not paused
        self.killed: str | None = None  # the step --now killed, until the wait ends
        self.resuming = False  # the `resume:` block and the check after it run
        self.block: BlockRun | None = None  # the block of the pause (or resume) in hand

    def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Step):
            self.step_started = time.time()

    def seen(self, wanted: Request | None) -> None:
        """What the scheduler read while attempts were in flight: a new request is said once
        (status.json: "pausing"), a withdrawn one forgotten."""
        if wanted == self.requested:
            return
        self.requested = wanted
        if wanted is not None:
            asked = events.PauseRequested(now=bool(wanted.get("now")), by=wanted.get("by"))
            self.run.bus.emit(asked)
        self.run.save_status()

    def hold(self, wanted: Request, check: Callable[[str], None]) -> None:
        """Wait while the control file is there: the `pause:` block when the wait begins, the
        `resume:` block and a look at the service (`check`, at phase CHECK_PHASE) when it ends.
        """
        run, st = self.run, self.run.state
        self.since, self.requested = time.time(), wanted
        st.phase = PHASE
        try:
            run.bus.emit(
                events.Paused(
                    iteration=st.iteration,
                    item=st.current_item,
                    now=bool(wanted.get("now")),
                    killed=self.killed,
                    by=wanted.get("by"),
                )
            )
            run.save_status()
            stopped = self._block("pause").ran > 0
            while read(self.path) is not None:
                run.signals.raise_pending()
                if run.stop.wait(POLL):
                    return
            seconds = round(time.time() - self.since, 3)
        finally:
            self.since, self.requested, self.killed, self.block = None, None, None, None
        st.phase, self.resuming = RESUMING, True
        try:
            run.bus.emit(events.Resumed(iteration=st.iteration, seconds=seconds))
            run.save_status()
            resumed = self._block("resume")
            if stopped or resumed.ran:
                self._check_service(stopped, resumed, check)
        finally:
            self.resuming, self.block = False, None
        st.phase = None
        run.save_status()

    def _block(self, which: Literal["pause", "resume"]) -> BlockRun:
        """A failed block is reported, never raised: no death, no strike, no end of the run."""
        book, run = self.run.plan.runbook, self.run
        specs = book.pause_steps if which == "pause" else book.resume_steps

        def shown(block: BlockRun) -> None:
            self.block = block

        return run_block(
            run, which, specs, cancel=run.stop, between=run.signals.raise_pending, shown=shown
        )

    def _check_service(
        self, stopped: bool, resumed: BlockRun, check: Callable[[str], None]
    ) -> None:
        """The service after the blocks, before the next iteration: a server the pause block
        stopped is started (a `start`, no death) when nothing listens; one the resume block
        started first gets `recovery.healthy_within` to answer, as after a recovery's steps."""
        run = self.run
        if not run.plan.runbook.probes:
            return
        if stopped:
            run.service.checked = False  # not running, not dead: as at a run's first check
        if resumed.ran and resumed.error is None:
            within = run.model.recovery.healthy_within
            run.health.wait_healthy(within, cancel=run.stop)
        check(CHECK_PHASE)

    # -- status.json ---------------------------------------------------------------
    def fields(self) -> PauseFields:
        """What status.json says about the pause, the step in hand and the item's attempts."""
        st = self.run.state
        pause: PauseStatus | None = None
        wanted, block = self.requested, self.block
        if self.since is not None or wanted is not None or self.resuming:
            state: Literal["pausing", "paused", "resuming"] = (
                "paused" if self.since is not None else "pausing"
            )
            pause = {
                "state": "resuming" if self.resuming else state,
                "since": self.since,
                "requested": (wanted or {}).get("requested"),
                "now": bool((wanted or {}).get("now")),
                "by": (wanted or {}).get("by"),
                "killed_step": self.killed,
                # the pause block while paused, the resume block while resuming; None: none
                "steps": block.state if block else None,
                "steps_error": block.error if block else None,
            }
        return {
            "paused": self.since is not None,
            "pause": pause,
            "step_started": self.step_started if st.phase else None,
            "attempts": st.strikes.get(st.current_item, 0) if st.current_item else 0,
        }
