"""`ralph-run pause` / `resume`: a running loop held at its iteration boundary, and let go.

The request is a control file, `.ralph/pause` (JSON: when it was asked, `now`, by whom),
written atomically by `ralph-run pause` (locally, or over the host's connection with `-i`) and
removed by `ralph-run resume`. The loop looks at it at each iteration boundary: `iterate` is
the one call the runner makes in place of `_iteration`. While the file is there the loop waits,
polling it every POLL s on the loop's stop event (SIGTERM and SIGINT interrupt the wait as
they interrupt a step), with `paused` in status.json and the phase `paused`; when the file goes,
it reads the checklist again (it may have been edited meanwhile) and goes on.

A pause asked for during an iteration lets the step in hand finish, and the rest of the
iteration (verify, its health checks) too: the item is settled as usual. `--now` stops the
running agent step instead, the way SIGTERM does (`execute.kill_all`: its process tree, TERM
then KILL), and ends the iteration there, before anything counts it: no strike, no retry, the
item stays `- [ ]` and is the next one taken after `resume`. A file left behind (the loop
ended, or was stopped, while paused) holds the next run before its first iteration.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ralph_runner.durable.files import write_atomic
from ralph_runner.errors import FatalError, Interrupted, Problem
from ralph_runner.loop.state import STATE_DIR
from ralph_runner.process import execute

if TYPE_CHECKING:
    from ralph_runner.loop.checklist import Item
    from ralph_runner.loop.runner import Runner

CONTROL = "pause"  # .ralph/pause
POLL = 0.5  # seconds between looks at the control file
PHASE = "paused"  # the loop's phase while it waits


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
    try:
        control_path(workdir).unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        path = str(control_path(workdir))
        raise FatalError(Problem(f"cannot remove: {e.strerror}", path)) from None
    return True


def read(path: Path) -> dict[str, Any] | None:
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
    return data if isinstance(data, dict) else {"now": False}


class PausedNow(Interrupted):
    """`pause --now` while a step ran: its tree was killed; the iteration ends, uncounted."""

    def __init__(self) -> None:
        BaseException.__init__(self, "pause --now")
        self.exit_code = 0


class _Control:
    """One runner's pause: what the loop's events say runs now, the watch during iterations,
    the wait at the boundary."""

    def __init__(self, runner: Runner) -> None:
        from ralph_runner.loop.runner import UNWATCHED

        self.runner = runner
        self.unwatched = UNWATCHED
        self.path = control_path(runner.store.workdir)
        self.agent_step: str | None = None  # the process step running now, killable by --now
        self.step_started: float | None = None  # epoch of the last `step` event
        self.requested: dict[str, Any] | None = None  # a request seen during an iteration
        self.since: float | None = None  # epoch when the wait began; None when not paused
        self.killed: str | None = None  # the step --now killed, until the wait ends
        runner.output.subscribe(self._on_event)

    def _on_event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "step":
            self.step_started = time.time()
            self.agent_step = None if fields.get("action") in self.unwatched else fields["step"]
        elif kind == "step-done":
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
            self.runner._iteration(item)
        except PausedNow:
            self._end_watch(done, watch)
            self.hold(self.requested or {"now": True})
            return
        finally:
            self._end_watch(done, watch)
        self.killed = None  # a --now that came after the last step: the iteration settled

    def hold(self, wanted: dict[str, Any]) -> None:
        runner, st = self.runner, self.runner.state
        self.since, self.requested = time.time(), wanted
        st.phase = PHASE
        try:
            runner.output.event(
                "paused",
                iteration=st.iteration,
                item=st.current_item,
                now=bool(wanted.get("now")),
                killed=self.killed,
                by=wanted.get("by"),
            )
            runner._save(status_only=True)
            while read(self.path) is not None:
                runner.signals.raise_pending()
                if runner.stop.wait(POLL):
                    return
            seconds = round(time.time() - self.since, 3)
        finally:
            self.since, self.requested, self.killed = None, None, None
        st.phase = None
        runner.output.event("resumed", iteration=st.iteration, seconds=seconds)
        runner._save(status_only=True)

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
                    self.runner._save(status_only=True)
                continue
            if wanted != self.requested:
                seen, self.requested = True, wanted
                self.runner.output.event(
                    "pause-requested", now=bool(wanted.get("now")), by=wanted.get("by")
                )
                self.runner._save(status_only=True)
            step = self.agent_step
            if wanted.get("now") and step is not None and self.runner.signals.pending is None:
                self.killed = step
                self.runner.signals.pending = PausedNow()  # raised when the killed step returns
                execute.kill_all()
                return

    # -- status.json ---------------------------------------------------------------
    def fields(self) -> dict[str, Any]:
        st = self.runner.state
        pause: dict[str, Any] | None = None
        wanted = self.requested
        if self.since is not None or wanted is not None:
            pause = {
                "state": "paused" if self.since is not None else "pausing",
                "since": self.since,
                "requested": (wanted or {}).get("requested"),
                "now": bool((wanted or {}).get("now")),
                "by": (wanted or {}).get("by"),
                "killed_step": self.killed,
            }
        return {
            "paused": self.since is not None,
            "pause": pause,
            "step_started": self.step_started if st.phase else None,
            "attempts": st.strikes.get(st.current_item, 0) if st.current_item else 0,
        }


_controls: weakref.WeakKeyDictionary[Runner, _Control] = weakref.WeakKeyDictionary()


def _control(runner: Runner) -> _Control:
    control = _controls.get(runner)
    if control is None:
        control = _controls[runner] = _Control(runner)
    return control


def iterate(runner: Runner, item: Item) -> None:
    """The runner's iteration, held while `.ralph/pause` is there (see the module's text)."""
    _control(runner).iterate(item)


def status_fields(runner: Runner) -> dict[str, Any]:
    """What status.json says about the pause, the step in hand and the item's attempts."""
    return _control(runner).fields()
