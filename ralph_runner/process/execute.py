"""The one way ralph-run starts a process.

Every command (loop step, collector, recovery step, shell probe) runs here, through the `sh`
library, with its traps closed: each command gets its own session (so a kill reaches the whole
tree and a Ctrl-C on the terminal does not), no TTY, stderr merged into stdout, and only the
*last* `max_output` bytes kept (the end of a log is what explains a death). On timeout, cancel or
shutdown the whole tree is killed (kill.py), TERM first, then KILL.

When ralph-run itself dies, even by `kill -9`, its commands die with it (tree_guard_pipe.py).
The running commands are registered (registry.py) for `kill_all` and for the next run;
SIGINT and SIGTERM kill them all and raise Interrupted (signals.py). What a step's commands
leave running is killed when the step ends (leftovers.py, `swept`). This module gives the names
its callers use: run, shell, kill_tree, kill_all, tree_guard, InterruptsRaise, swept.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import sh

from ralph_runner.process import leftovers, registry
from ralph_runner.process.kill import KILL_GRACE, kill_tree
from ralph_runner.process.leftovers import swept
from ralph_runner.process.registry import Running, kill_all
from ralph_runner.process.signals import InterruptsRaise
from ralph_runner.process.tree_guard_pipe import dies_with, guard, tree_guard
from ralph_runner.process.watched import OutputTail, Watched

__all__ = [
    "CANNOT_START",
    "DEFAULT_MAX_OUTPUT",
    "IDLE_EVERY",
    "IdleWatch",
    "InterruptsRaise",
    "Result",
    "kill_all",
    "kill_tree",
    "run",
    "shell",
    "swept",
    "tree_guard",
]

# sh logs every start and exit at INFO: noise in `-v` output, where our own events say more.
logging.getLogger("sh").setLevel(logging.WARNING)
log = logging.getLogger(__name__)

DEFAULT_MAX_OUTPUT = 64 * 1024
CANNOT_START = 127  # what a shell reports for a command it cannot run
_POLL = 0.25  # seconds between checks of `cancel` and the deadline (output and exit wake at once)
IDLE_EVERY = 1.0  # seconds between asks of an IdleWatch whether the command stalled
DRAIN = 2.0  # seconds the output may go on after the command ended (a grandchild holding it)


@dataclass
class Result:
    """What a finished (or killed) command left behind."""

    command: str  # display form
    exit_code: int | None  # None when killed before it exited on its own; 128+N: died of signal N
    output: str  # combined stdout+stderr (utf-8, errors replaced), last max_output bytes
    cut_bytes: int  # bytes dropped from the front; 0 = complete
    timed_out: bool
    cancelled: bool  # killed because `cancel` was set (or by kill_all)
    seconds: float
    stalled: str | None = None  # killed because its IdleWatch said so: the watch's reason

    @property
    def truncated(self) -> bool:
        return self.cut_bytes > 0

    @property
    def ok(self) -> bool:
        return (
            self.exit_code == 0 and not self.timed_out and not self.cancelled and not self.stalled
        )


class IdleWatch(Protocol):
    """Decides whether a running command has stalled (the loop's `idle_timeout`: the policy is
    the caller's, see loop/idle.py). run() asks it every IDLE_EVERY s, with the command's pid
    (its session's leader: the tree is under it) and how many bytes of output it has printed so
    far; a reason (not None) kills the tree as a timeout does, and becomes Result.stalled. A new
    pid is a new command: the watch starts over (a task's retry)."""

    def stalled(self, pid: int, output_bytes: int) -> str | None: ...


def run(
    argv: list[str],
    *,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    max_output: int = DEFAULT_MAX_OUTPUT,
    cancel: threading.Event | None = None,
    on_output: Callable[[str], None] | None = None,
    stdin: str | None = None,
    hold_stdin: bool = False,
    stdin_first: bytes = b"",
    display: str | None = None,
    idle: IdleWatch | None = None,
    grace: float = KILL_GRACE,
) -> Result:
    """Run argv to completion, timeout or cancel; never raises for a command that fails.

    `env` is added to ralph-run's own environment. `stdin` is fed to the command; without it the
    command reads /dev/null, or, with `hold_stdin`, a pipe that stays open until it exits (the
    ssh connection uses that as a lifeline for the remote command; `stdin_first` is written to
    that pipe first, by a thread, so that a large one never holds up the start: the remote
    command's environment, kept off every command line). `display` is how the command
    is shown in the Result (default: argv, shell-quoted). `idle` may kill a command that
    stalled (see IdleWatch). `grace`: the seconds between TERM and KILL when a timeout, a
    cancel or a stall kills it (the fleet gives a loop time to save its state).
    """
    command = display if display is not None else shlex.join(argv)
    started = time.monotonic()
    # a step that sweeps what it leaves running marks its commands (leftovers.py)
    added = {**{k: str(v) for k, v in (env or {}).items()}, **leftovers.marker()}
    full_env = {**os.environ, **added} if added else None

    def cannot_start(reason: str) -> Result:
        return Result(
            command=command,
            exit_code=CANNOT_START,
            output=reason + "\n",
            cut_bytes=0,
            timed_out=False,
            cancelled=False,
            seconds=_since(started),
        )

    if cancel is not None and cancel.is_set():
        return Result(
            command=command,
            exit_code=None,
            output="",
            cut_bytes=0,
            timed_out=False,
            cancelled=True,
            seconds=0.0,
        )
    if cwd is not None and not os.path.isdir(cwd):
        return cannot_start(f"cannot start {command}: no such directory: {os.fspath(cwd)}")
    search_path = (full_env or os.environ).get("PATH", os.defpath)
    program = shutil.which(argv[0], path=search_path) if argv else None
    if program is None:
        reason = f"{argv[0]}: command not found" if argv else "empty command"
        return cannot_start(f"cannot start {command}: {reason}")

    tail = OutputTail(max_output, on_output)
    lifeline = os.pipe() if hold_stdin and stdin is None else None
    pipe_out, pipe_in = os.pipe()  # the command's stdout and stderr, read here
    try:
        try:
            running = _start(program, argv[1:], cwd, full_env, stdin, lifeline, pipe_in)
        except (sh.ForkException, OSError) as error:
            return cannot_start(f"cannot start {command}: {_last_line(str(error))}")
        else:
            leftovers.started(running.pid)
        finally:
            os.close(pipe_in)
            if lifeline is not None:
                os.close(lifeline[0])  # the child has its own copy now
        if lifeline is not None and stdin_first:
            _feed(os.dup(lifeline[1]), stdin_first)
        try:
            watched = Watched(running, pipe_out, tail)
            stopped = _wait(running, started, timeout, cancel, watched, idle, grace)
        finally:
            registry.remove(running.pid)
            guard.tell(f"-{running.pid}")
    finally:
        os.close(pipe_out)
        if lifeline is not None:
            os.close(lifeline[1])  # EOF on the command's stdin
    tail.close()
    output, cut = tail.result()
    cancelled = stopped == "cancel" or running.killed_by_shutdown
    exit_code = None if stopped or running.killed_by_shutdown else _exit_status(running.command)
    return Result(
        command=command,
        exit_code=exit_code,
        output=output,
        cut_bytes=cut,
        timed_out=stopped == "timeout",
        cancelled=cancelled,
        seconds=_since(started),
        stalled=_stall_reason(stopped) if not cancelled else None,
    )


def _feed(fd: int, data: bytes) -> None:
    """Write `data` to `fd` (a copy of the lifeline's writing end) in a daemon thread, then
    close the copy; a command that ended meanwhile (a broken pipe) simply gets no more."""

    def write() -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            pass
        finally:
            os.close(fd)

    threading.Thread(target=write, name="stdin-first", daemon=True).start()


def shell(command: str, **kwargs) -> Result:
    """Run a string with bash -c (the `shell` action); same keywords as run()."""
    kwargs.setdefault("display", command)
    return run(["bash", "-c", command], **kwargs)


def _start(
    program: str,
    args: list[str],
    cwd: str | os.PathLike | None,
    env: dict[str, str] | None,
    stdin: str | None,
    lifeline: tuple[int, int] | None,
    output: int,
) -> Running:
    """Start the command and register it, atomically as far as kill_all is concerned."""
    # Any: sh's annotations omit what it takes at run time, a file descriptor for `_in`
    options: dict[str, Any] = {
        "_bg": True,
        "_bg_exc": False,  # we read the exit code ourselves; no exception from sh's thread
        "_new_session": True,  # its own session and process group: a kill reaches the tree
        "_tty_out": False,
        "_err_to_out": True,
        # A file descriptor: sh starts no reader thread (one that would wake every 0.1 s for
        # as long as the command runs); run() reads the pipe, in the same poll as the exit.
        "_out": output,
        "_ok_code": range(-64, 256),  # every status is an answer, not an exception
        "_preexec_fn": dies_with(os.getpid(), guard.fd),  # in the child, after setsid
    }
    if cwd is not None:
        options["_cwd"] = os.fspath(cwd)
    if env is not None:
        options["_env"] = env
    with open(os.devnull, "rb") as devnull, registry.lock:
        options["_in"] = stdin if stdin is not None else lifeline[0] if lifeline else devnull
        try:
            running = registry.add(sh.Command(program)(*args, **options))
        except (sh.ForkException, OSError):
            raise  # it did not start: run() reports it
        except BaseException:
            # SIGTERM's handler raises in the main thread, possibly mid-spawn: kill_all could
            # not see this child yet, so it must not outlive us unregistered.
            registry.kill_unregistered_children()
            raise
        registry.changed()
    return running


def _wait(
    running: Running,
    started: float,
    timeout: float | None,
    cancel: threading.Event | None,
    watched: Watched,
    idle: IdleWatch | None = None,
    grace: float = KILL_GRACE,
) -> str | None:
    """Read the command's output until it exits; on timeout, cancel or a stall kill its tree
    and say which happened ("timeout", "cancel", "stalled: REASON"). Then the rest of its
    output, and sh reaps it."""
    deadline = None if timeout is None else started + timeout
    reason = None
    next_idle = time.monotonic() + IDLE_EVERY
    try:
        while not watched.exited:
            watched.wait(_POLL if deadline is None else _clamp(deadline, _POLL))
            if watched.exited:
                break
            if cancel is not None and cancel.is_set():
                reason = "cancel"
            elif deadline is not None and time.monotonic() >= deadline:
                reason = "timeout"
            elif idle is not None and time.monotonic() >= next_idle:
                next_idle = time.monotonic() + IDLE_EVERY
                stalled = _ask(idle, running.pid, watched.tail.total)
                if isinstance(stalled, str):
                    reason = f"stalled: {stalled}"
                elif stalled is False:
                    idle = None  # it failed: no more asking
            if reason:
                kill_tree(running.pid, grace)
                break
        watched.drain(DRAIN)
    finally:
        watched.close()
    running.command.wait()
    return reason


def _stall_reason(stopped: str | None) -> str | None:
    prefix = "stalled: "
    return stopped[len(prefix) :] if stopped and stopped.startswith(prefix) else None


def _ask(idle: IdleWatch, pid: int, output_bytes: int) -> str | bool | None:
    """The watch's answer; False when it raised (reported once: the command runs on unwatched,
    as a broken on_output callback does not stop the reading either)."""
    try:
        return idle.stalled(pid, output_bytes)
    except Exception:
        log.exception("idle watch failed; idle_timeout disabled for this command")
        return False


def _exit_status(command: sh.RunningCommand) -> int | None:
    code = command.process.exit_code  # None only if something else reaped our child
    if code is not None and code < 0:
        return 128 - code  # killed by signal N -> 128+N, as a shell says
    return code


def _clamp(deadline: float, most: float) -> float:
    return max(0.0, min(most, deadline - time.monotonic()))


def _since(started: float) -> float:
    return time.monotonic() - started


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text
