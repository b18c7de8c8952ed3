"""`ralph-run pause` / `resume`: a running loop held at its iteration boundary, and let go.

The request is a control file, `.ralph/pause` (JSON: when it was asked, `now`, by whom),
written atomically by `ralph-run pause` (locally, or over the host's connection with `-i`) and
removed by `ralph-run resume`. The runner holds a `Pause` (it follows the run's events: which
step runs now) and looks at the file at each iteration boundary: `Pause.iterate` is the one call
the runner makes in place of `run_iteration`. While the file is there the loop waits,
polling it every POLL s on the loop's stop event (SIGTERM and SIGINT interrupt the wait as
they interrupt a step), with `paused` in status.json and the phase `paused`; when the file goes,
it reads the checklist again (it may have been edited meanwhile) and goes on.

A pause asked for during an iteration lets the step in hand finish, and the rest of the
iteration (verify, its health checks) too: the item is settled as usual. `--now` stops the
running agent step instead, the way SIGTERM does (`execute.kill_all`: its process tree, TERM
then KILL), and ends the iteration there, before anything counts it: no strike, no retry, the
item stays `- [ ]` and is the next one taken after `resume`. A file left behind (the loop
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict

from ralph_runner import events
from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError, Interrupted, Problem
from ralph_runner.process import execute
from ralph_runner.workspace.state_files import STATE_DIR

if TYPE_CHECKING:
    from ralph_runner.liveness.health import Health
    from ralph_runner.liveness.service import Service
    from ralph_runner.loop.state import State, Store
    from ralph_runner.output import EventBus
    from ralph_runner.runbook.loader import TaskSpec
    from ralph_runner.runbook.plan import Plan
    from ralph_runner.workspace.checklist import Counts, Item
    from ralph_runner.workspace.status_file import Pause as PauseStatus
    from ralph_runner.workspace.status_file import PauseFields

CONTROL = "pause"  # .ralph/pause
POLL = 0.5  # seconds between looks at the control file
PHASE = "paused"  # the loop's phase while it waits
RESUMING = "resuming"  # ... while the `resume:` block and the check after it run
CHECK_PHASE = "resume"  # the phase of the service check at resume (a death's `phase`)


class Loop(Protocol):
    """What the pause needs of the loop it holds (loop/runner.py's Runner)."""

    store: Store
    bus: EventBus
    state: State
    plan: Plan
    signals: execute.InterruptsRaise
    stop: threading.Event
    service: Service
    health: Health

    def run_iteration(self, item: Item) -> None: ...
    def save(self, status_only: bool = False) -> None: ...
    def checklist_counts(self) -> Counts: ...
    def forget_counts(self) -> None: ...
    def ensure_service(self, phase: str, context: dict[str, object] | None = None) -> None: ...


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


@dataclass
class Block:
    """A `pause:` or `resume:` block's run, as status.json shows it while it matters."""

    which: Literal["pause", "resume"]
    state: Literal["running", "done", "failed"] = "running"
    error: str | None = None  # why it failed: the step and how it ended
    ran: int = 0  # steps that ran (not skipped by their `when:`)


class PausedNow(Interrupted):
    """`pause --now` while a step ran: its tree was killed; the iteration ends, uncounted."""

    def __init__(self) -> None:
        BaseException.__init__(self, "pause --now")
        self.exit_code = 0


class Pause:
    """One runner's pause, held by the runner: what the loop's events say runs now (a follower
    of them), the watch during iterations, the wait at the boundary."""

    def __init__(self, runner: Loop) -> None:
        from ralph_runner.actions import UNWATCHED  # the loop's only: `ralph-run pause` needs none

        self.unwatched = UNWATCHED
        self.runner = runner
        self.path = control_path(runner.store.workdir)
        self.agent_step: str | None = None  # the process step running now, killable by --now
        self.step_started: float | None = None  # epoch of the last `step` event
        self.requested: Request | None = None  # a request seen during an iteration
        self.since: float | None = None  # epoch when the wait began; None when not paused
        self.killed: str | None = None  # the step --now killed, until the wait ends
        self.resuming = False  # the `resume:` block and the check after it run
        self.block: Block | None = None  # the block of the pause (or resume) in hand

    def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Step):
            self.step_started = time.time()
            self.agent_step = None if event.action in self.unwatched else event.step
        elif isinstance(event, events.StepDone):
            self.agent_step = None

    # -- the iteration boundary ---------------------------------------------------
    def iterate(self, item: Item) -> None:
        wanted = read(self.path)
        if wanted is not None:
            self.hold(wanted)
            return  # the loop reads the checklist again: it may have changed meanwhile
        done = threading.Event()
        watch = threading.Thread(target=self._watch, args=(done,), name="pause", daemon=True)
        watch.start()
        try:
            self.runner.run_iteration(item)
        except PausedNow:
            self._end_watch(done, watch)
            self.hold(self.requested or {"now": True})
            return
        finally:
            self._end_watch(done, watch)
        self.killed = None  # a --now that came after the last step: the iteration settled

    def hold(self, wanted: Request) -> None:
        """Wait while the control file is there: the `pause:` block when the wait begins, the
        `resume:` block and a look at the service when it ends."""
        runner, st = self.runner, self.runner.state
        book = runner.plan.runbook
        self.since, self.requested = time.time(), wanted
        st.phase = PHASE
        try:
            runner.bus.emit(
                events.Paused(
                    iteration=st.iteration,
                    item=st.current_item,
                    now=bool(wanted.get("now")),
                    killed=self.killed,
                    by=wanted.get("by"),
                )
            )
            runner.save(status_only=True)
            stopped = self._block("pause", book.pause_steps).ran > 0
            while read(self.path) is not None:
                runner.signals.raise_pending()
                if runner.stop.wait(POLL):
                    return
            seconds = round(time.time() - self.since, 3)
        finally:
            self.since, self.requested, self.killed, self.block = None, None, None, None
        st.phase, self.resuming = RESUMING, True
        try:
            runner.bus.emit(events.Resumed(iteration=st.iteration, seconds=seconds))
            runner.save(status_only=True)
            resumed = self._block("resume", book.resume_steps)
            if stopped or resumed.ran:
                self._check_service(stopped, resumed)
        finally:
            self.resuming, self.block = False, None
        st.phase = None
        runner.save(status_only=True)

    # -- the runbook's `pause:` and `resume:` blocks ----------------------------------
    def _block(self, which: Literal["pause", "resume"], specs: list[TaskSpec]) -> Block:
        """Run one block once: its steps in order, each as a recovery step runs (on the target
        host, its keywords and templates), a failing one ending the block unless it ignores
        errors. Its failure is reported, never raised: no death, no strike, no end of the run."""
        from ralph_runner.runbook import tasks  # the loop's only: `ralph-run pause` needs none

        block = Block(which)
        if not specs:
            return block
        runner = self.runner
        self.block = block
        runner.save(status_only=True)
        started = time.monotonic()
        group = tasks.TaskGroup(runner.plan)
        variables = self._variables(which)

        def starting(spec: TaskSpec, skipped: str | None) -> None:
            if skipped is None:
                block.ran += 1
            kind = events.PauseStep if which == "pause" else events.ResumeStep
            runner.bus.emit(kind(step=spec.name, skipped=skipped or None))

        block.error = tasks.run_steps(
            specs,
            group,
            variables,
            runner.stop,
            starting,
            between=runner.signals.raise_pending,
            template_errors_end=True,  # the runbook's to fix: the block's end, not the run's
        ).failure
        block.state = "failed" if block.error else "done"
        runner.forget_counts()  # a step may have changed the checklist
        ended = events.PauseSteps if which == "pause" else events.ResumeSteps
        runner.bus.emit(
            ended(
                ok=block.error is None,
                ran=block.ran,
                seconds=round(time.monotonic() - started, 3),
                error=block.error,
            )
        )
        runner.save(status_only=True)
        return block

    def _variables(self, which: str) -> dict[str, object]:
        """What the blocks' templates see: the runbook's variables and the loop's counts; no
        `item` (none is in hand) and no `death`."""
        runner, st = self.runner, self.runner.state
        return {
            **runner.plan.variables,
            "iteration": st.iteration,
            "deaths": st.deaths,
            "checklist": runner.checklist_counts().as_dict(),
            "phase": which,
        }

    def _check_service(self, stopped: bool, resumed: Block) -> None:
        """The service after the blocks, before the next iteration: a server the pause block
        stopped is started (a `start`, no death) when nothing listens; one the resume block
        started first gets `recovery.healthy_within` to answer, as after a recovery's steps."""
        runner = self.runner
        if not runner.plan.runbook.probes:
            return
        if stopped:
            runner.service.checked = False  # not running, not dead: as at a run's first check
        if resumed.ran and resumed.error is None:
            within = runner.plan.model.recovery.healthy_within
            runner.health.wait_healthy(within, cancel=runner.stop)
        runner.ensure_service(CHECK_PHASE)

    def _end_watch(self, done: threading.Event, watch: threading.Thread) -> None:
        """Stop the watch; a --now it set that no step boundary raised is dropped."""
        done.set()
        watch.join()
        if isinstance(self.runner.signals.pending, PausedNow):
            self.runner.signals.pending = None

    def _watch(self, done: threading.Event) -> None:
        """During the iteration: see a request (status.json says "pausing") and, with --now,
        kill the running agent step; the step's return raises PausedNow in the loop."""
        seen = False
        while not done.wait(POLL):
            wanted = read(self.path)
            if wanted is None:
                if seen:
                    seen, self.requested = False, None
                    self.runner.save(status_only=True)
                continue
            if wanted != self.requested:
                seen, self.requested = True, wanted
                asked = events.PauseRequested(now=bool(wanted.get("now")), by=wanted.get("by"))
                self.runner.bus.emit(asked)
                self.runner.save(status_only=True)
            step = self.agent_step
            if wanted.get("now") and step is not None and self.runner.signals.pending is None:
                self.killed = step
                self.runner.signals.pending = PausedNow()  # raised when the killed step returns
                execute.kill_all()
                return

    # -- status.json ---------------------------------------------------------------
    def fields(self) -> PauseFields:
        """What status.json says about the pause, the step in hand and the item's attempts."""
        st = self.runner.state
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
