"""The one way ralph-run starts a process.

Every command (loop step, collector, recovery step, shell probe) runs here, through the `sh`
library, with its traps closed: each command gets its own session (so a kill reaches the whole
tree and a Ctrl-C on the terminal does not), no TTY, stderr merged into stdout, and only the
*last* `max_output` bytes kept (the end of a log is what explains a death). On timeout, cancel or
shutdown the whole tree is killed: the session's process group plus every descendant psutil can
see (grandchildren that moved to their own group or session included), TERM first, then KILL.

When ralph-run itself dies, even by `kill -9`, its commands die with it. Each is started with
PR_SET_PDEATHSIG, a signal the kernel sends it when the *thread* that forked it ends (`sh`
forks in the calling thread, and every caller waits in run() until its command has ended, so
that thread outlives the command): within `tree_guard()` (the loop) it is SIGSTOP, and a small
process (tree_guard.py) kills the frozen tree whole when ralph-run's end of a pipe closes;
outside, it is SIGKILL (which reaches the command only, not its children).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import fcntl
import logging
import math
import os
import select
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
import sh

from ralph_runner.errors import Interrupted

log = logging.getLogger(__name__)
# sh logs every start and exit at INFO: noise in `-v` output, where our own events say more.
logging.getLogger("sh").setLevel(logging.WARNING)

DEFAULT_MAX_OUTPUT = 64 * 1024
CANNOT_START = 127  # what a shell reports for a command it cannot run
_READ_SIZE = 64 * 1024  # bytes per read from the command's output pipe
_POLL = 0.25  # seconds between checks of `cancel` and the deadline (output and exit wake at once)
IDLE_EVERY = 1.0  # seconds between asks of an IdleWatch whether the command stalled
_REAP_POLL = 0.05  # ... where no pidfd tells the exit (a thread reaps the command)
_GONE_POLL = 0.01  # seconds between looks at a killed tree
DRAIN = 2.0  # seconds the output may go on after the command ended (a grandchild holding it)
KILL_GRACE = 2.0  # seconds between TERM and KILL
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


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


class _OutputTail:
    """Receives the output as read from the command's pipe and keeps only the last `limit`
    bytes: raw bytes, so byte counts stay exact and a UTF-8 character split across two reads is
    decoded whole."""

    def __init__(self, limit: int, on_output: Callable[[str], None] | None) -> None:
        self.limit = max(limit, 0)
        self.total = 0
        self._buffer = bytearray()
        self._on_output = on_output
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self._buffer += chunk
        if len(self._buffer) > 2 * self.limit + _READ_SIZE:  # trim in batches, not every chunk
            del self._buffer[: len(self._buffer) - self.limit]
        if self._on_output is not None:
            self._notify(self._decoder.decode(chunk))

    def close(self) -> None:
        if self._on_output is not None:
            self._notify(self._decoder.decode(b"", final=True))

    def _notify(self, text: str) -> None:
        # The callback runs while the command's pipe is read: if it raised, reading would stop
        # and a chatty command would block forever on a full pipe. Report once, stop calling it.
        if not text or self._on_output is None:
            return
        try:
            self._on_output(text)
        except Exception:
            log.exception("on_output callback failed; live output disabled for this command")
            self._on_output = None

    def result(self) -> tuple[str, int]:
        """The kept text and how many bytes were cut from the front."""
        kept = bytes(self._buffer[-self.limit :]) if self.limit else b""
        cut = self.total - len(kept)
        if cut:  # don't start the text with half a character
            skip = 0
            while skip < min(3, len(kept)) and kept[skip] & 0xC0 == 0x80:
                skip += 1
            kept, cut = kept[skip:], cut + skip
        return kept.decode("utf-8", errors="replace"), cut


class _Running:
    """One started command, as the registry (and kill_all) sees it."""

    def __init__(self, command: sh.RunningCommand) -> None:
        self.command = command
        self.pid: int = command.pid
        self.killed_by_shutdown = False


_running: dict[int, _Running] = {}
_on_change: Callable[[list[int]], None] | None = None
# Re-entrant: kill_all runs from a signal handler, possibly while the same (main) thread is
# inside run() holding this lock.
_registry_lock = threading.RLock()


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
) -> Result:
    """Run argv to completion, timeout or cancel; never raises for a command that fails.

    `env` is added to ralph-run's own environment. `stdin` is fed to the command; without it the
    command reads /dev/null, or, with `hold_stdin`, a pipe that stays open until it exits (the
    ssh connection uses that as a lifeline for the remote command; `stdin_first` is written to
    that pipe first, by a thread, so that a large one never holds up the start: the remote
    command's environment, kept off every command line). `display` is how the command
    is shown in the Result (default: argv, shell-quoted). `idle` may kill a command that
    stalled (see IdleWatch).
    """
    command = display if display is not None else shlex.join(argv)
    started = time.monotonic()
    full_env = {**os.environ, **{k: str(v) for k, v in env.items()}} if env else None

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

    tail = _OutputTail(max_output, on_output)
    lifeline = os.pipe() if hold_stdin and stdin is None else None
    pipe_out, pipe_in = os.pipe()  # the command's stdout and stderr, read here
    try:
        try:
            running = _start(program, argv[1:], cwd, full_env, stdin, lifeline, pipe_in)
        except (sh.ForkException, OSError) as error:
            return cannot_start(f"cannot start {command}: {_last_line(str(error))}")
        finally:
            os.close(pipe_in)
            if lifeline is not None:
                os.close(lifeline[0])  # the child has its own copy now
        if lifeline is not None and stdin_first:
            _feed(os.dup(lifeline[1]), stdin_first)
        try:
            watched = _Watched(running, pipe_out, tail)
            stopped = _wait(running, started, timeout, cancel, watched, idle)
        finally:
            with _registry_lock:
                _running.pop(running.pid, None)  # no _changed(): a dead pid in the record is
                # harmless (its start time no longer matches), and it saves a write per command
            _tree_guard.tell(f"-{running.pid}")
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


def on_running_change(callback: Callable[[list[int]], None] | None) -> None:
    """Tell `callback` the pids of the running commands whenever one starts, so a run killed
    with -9 leaves a record of the process trees its successor must clear away."""
    global _on_change
    _on_change = callback


def _changed() -> None:
    if _on_change is not None:
        _on_change(list(_running))


def kill_tree(pid: int, grace: float = KILL_GRACE) -> None:
    """Kill pid's process group and every descendant: TERM, up to `grace` s, then KILL."""
    _kill_trees([pid], grace)


def kill_all(grace: float = KILL_GRACE) -> None:
    """Kill the trees of every command still running (ralph-run's SIGTERM/SIGINT path)."""
    with _registry_lock:
        victims = list(_running.values())
        for running in victims:
            running.killed_by_shutdown = True
    _kill_trees([running.pid for running in victims], grace)


def _start(
    program: str,
    args: list[str],
    cwd: str | os.PathLike | None,
    env: dict[str, str] | None,
    stdin: str | None,
    lifeline: tuple[int, int] | None,
    output: int,
) -> _Running:
    """Start the command and register it, atomically as far as kill_all is concerned."""
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
        "_preexec_fn": _dies_with(os.getpid(), _tree_guard.fd),  # in the child, after setsid
    }
    if cwd is not None:
        options["_cwd"] = os.fspath(cwd)
    if env is not None:
        options["_env"] = env
    with open(os.devnull, "rb") as devnull, _registry_lock:
        options["_in"] = stdin if stdin is not None else lifeline[0] if lifeline else devnull
        try:
            command = sh.Command(program)(*args, **options)
            running = _Running(command)
            _running[running.pid] = running
        except (sh.ForkException, OSError):
            raise  # it did not start: run() reports it
        except BaseException:
            # SIGTERM's handler raises in the main thread, possibly mid-spawn: kill_all could
            # not see this child yet, so it must not outlive us unregistered.
            _kill_unregistered_children()
            raise
        _changed()
    return running


def _dies_with(parent: int, guard_fd: int | None) -> Callable[[], None] | None:
    """A pre-exec function: when the thread that forked the child ends (with ralph-run, at the
    latest), the child is frozen for the tree guard to kill with its tree, or killed outright
    when no tree guard runs.

    The child registers itself with the tree guard and lets go of the pipe *before* the prctl:
    a child frozen unregistered, or frozen holding the pipe open (the tree guard would wait for
    ever), cannot happen. A parent that died before the prctl is caught by getppid().
    """
    if _LIBC is None:
        return None
    signum = signal.SIGKILL if guard_fd is None else signal.SIGSTOP

    def die_with_parent() -> None:
        if guard_fd is not None:
            # sh restored SIGPIPE's default already: a dead tree guard must not kill us here
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)
            with contextlib.suppress(OSError):  # full or dead: the running-tree record remains
                os.write(guard_fd, f"+{os.getpid()}\n".encode("ascii"))
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.close(guard_fd)
        _LIBC.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # nothing started yet: no tree to keep whole

    return die_with_parent


class _TreeGuard:
    """ralph-run's end of the tree guard's pipe (see tree_guard.py); inert until started."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.process: sh.RunningCommand | None = None

    def start(self) -> None:
        read_end, write_end = os.pipe()  # both close-on-exec: no command inherits them
        fcntl.fcntl(write_end, fcntl.F_SETFL, os.O_NONBLOCK)  # never block a command's start
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        try:
            with os.fdopen(read_end, "rb") as pipe, open(os.devnull, "r+b") as devnull:
                self.process = sh.Command(sys.executable)(
                    "-m",
                    "ralph_runner.process.tree_guard",
                    _bg=True,
                    _bg_exc=False,
                    _new_session=True,  # a Ctrl-C on the terminal is not for it
                    _in=pipe,
                    _out=devnull,
                    _err=devnull,
                    _tty_out=False,
                    _env=env,
                    _ok_code=tuple(range(-64, 256)),  # any exit status, any signal
                )
        except (sh.ForkException, OSError) as error:
            os.close(write_end)
            log.warning("no tree guard (%s): commands may outlive a killed ralph-run", error)
            return
        self.fd = write_end

    def tell(self, message: str) -> None:
        fd = self.fd
        if fd is None:
            return
        try:
            os.write(fd, f"{message}\n".encode("ascii"))
        except BlockingIOError:
            pass  # it is busy killing or stuck: the running-tree record is the fallback
        except OSError:
            self.fd = None  # it died: nothing to tell

    def stop(self) -> None:
        """Close the pipe: with no command registered the tree guard just exits; reap it."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        process, self.process = self.process, None
        if process is not None:
            if not _exits_within(process.pid, 5):
                kill_tree(process.pid)
            process.wait()


_tree_guard = _TreeGuard()


@contextlib.contextmanager
def tree_guard() -> Iterator[None]:
    """Within this block, a kill -9 of this process takes the commands' trees with it
    (within a second: see tree_guard.py); the loop runs in it."""
    _tree_guard.start()
    try:
        yield
    finally:
        _tree_guard.stop()


def _wait(
    running: _Running,
    started: float,
    timeout: float | None,
    cancel: threading.Event | None,
    watched: _Watched,
    idle: IdleWatch | None = None,
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
                kill_tree(running.pid)
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


def _exits_within(pid: int, seconds: float) -> bool:
    """Has our child `pid` exited (not reaped: sh does) within `seconds`?"""
    deadline = time.monotonic() + seconds
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        while not os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_REAP_POLL)
        return True
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])
    finally:
        os.close(pidfd)


class _Watched:
    """A command's output pipe and its exit in one poll: output is handed on as it comes, the
    exit is seen at once, and nothing wakes in between. The exit comes from the process's pidfd
    (Linux 5.3+), which does not reap it (sh does); on older kernels a thread reaps it."""

    def __init__(self, running: _Running, output: int, tail: _OutputTail) -> None:
        self.command, self.output, self.tail = running.command, output, tail
        self.poller = select.poll()
        self.poller.register(output, select.POLLIN)
        self.open = True  # the pipe has not reached end-of-file
        self.exited = False
        self.reaped: threading.Event | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(running.pid)
        except OSError:
            self.pidfd = None
            self.reaped = threading.Event()
            threading.Thread(target=self._reap, name=f"reap {running.pid}", daemon=True).start()
        else:
            self.poller.register(self.pidfd, select.POLLIN)

    def _reap(self) -> None:
        assert self.reaped is not None
        try:
            self.command.wait()
        finally:
            self.reaped.set()

    def wait(self, seconds: float) -> None:
        """Hand on what output comes, note the exit; at most `seconds`."""
        if self.reaped is not None:
            seconds = min(seconds, _REAP_POLL)
        for fd, _ in self.poller.poll(math.ceil(seconds * 1000)):
            if fd == self.output:
                self._read()
            elif fd == self.pidfd:
                self.exited = True
                self.poller.unregister(fd)  # readable from now on: stop asking
        if self.reaped is not None and self.reaped.is_set():
            self.exited = True

    def drain(self, seconds: float) -> None:
        """The output still in the pipe, until end-of-file or `seconds` (a grandchild that keeps
        the pipe open after the command ended is not waited for)."""
        if self.pidfd is not None and not self.exited:
            self.poller.unregister(self.pidfd)
        deadline = time.monotonic() + seconds
        while self.open and (left := deadline - time.monotonic()) > 0:
            if not self.poller.poll(math.ceil(left * 1000)):
                return
            self._read()

    def _read(self) -> None:
        chunk = os.read(self.output, _READ_SIZE)
        if chunk:
            self.tail.write(chunk)
        else:
            self.open = False
            self.poller.unregister(self.output)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)


def _kill_unregistered_children() -> None:
    """Kill the trees of our children that the registry does not know: every process we start
    is registered as soon as it exists, so an unknown child was caught mid-spawn."""
    for child in psutil.Process().children():
        if child.pid not in _running:
            kill_tree(child.pid)


def _kill_trees(pids: Iterable[int], grace: float) -> None:
    """TERM every tree, wait up to `grace` for all of them together, then KILL what is left."""
    spared = _ourselves()
    pids = [pid for pid in pids if pid not in spared]
    victims = [p for p in _descendants(pids) if p.pid not in spared]
    _signal(pids, victims, signal.SIGTERM)
    alive = _wait_gone(victims, grace)
    # Anything a dying process spawned during the grace period is still under the survivors.
    for process in _descendants_of(alive):
        if process not in alive:
            alive.append(process)
    _signal(pids, alive, signal.SIGKILL)


def _ourselves() -> set[int]:
    """Pids and group ids a kill must never hit: init, ralph-run, its group and ancestors."""
    return {0, 1, os.getpgrp(), *lineage()}


def lineage() -> set[int]:
    """This process's pid and its ancestors', read up the kernel's parent links. Not psutil's
    parents(): it raises NoSuchProcess when an ancestor ends while the chain is read; here that
    ends the walk (the processes below it have a new parent by then), with what was read."""
    pids: set[int] = set()
    pid = os.getpid()
    while pid > 0 and pid not in pids:
        pids.add(pid)
        try:
            pid = psutil.Process(pid).ppid()
        except psutil.Error:
            break
    return pids


def _wait_gone(processes: list[psutil.Process], grace: float) -> list[psutil.Process]:
    """Poll until every process is gone (or a zombie) or `grace` runs out; return the rest.

    Not psutil.wait_procs: it would reap our own children, stealing the exit status that sh's
    waitpid is waiting for.
    """
    deadline = time.monotonic() + grace
    while True:
        processes = [p for p in processes if _alive(p)]
        if not processes or time.monotonic() >= deadline:
            return processes
        time.sleep(_GONE_POLL)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants(pids: list[int]) -> list[psutil.Process]:
    """Leaders and all their descendants, collected before any dies: orphans get reparented."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return processes + [p for p in _descendants_of(processes) if p not in processes]


def _descendants_of(processes: list[psutil.Process]) -> list[psutil.Process]:
    found: list[psutil.Process] = []
    for process in processes:
        try:
            found.extend(p for p in process.children(recursive=True) if p not in found)
        except psutil.NoSuchProcess:
            continue
    return found


def _signal(groups: list[int], processes: list[psutil.Process], signum: int) -> None:
    """Signal each group (each command is its session's leader) and each process."""
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)
    for process in processes:
        # psutil refuses to signal a pid that was reused meanwhile
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(signum)


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


class InterruptsRaise:
    """SIGINT/SIGTERM: every running command's tree is killed (TERM, `grace` s, KILL), then
    Interrupted is raised in the main thread, so `finally` blocks save state. `on_signal` runs
    first (the fleet stops starting hosts).

    A handler that happens to run inside a weakref callback or a `__del__` has its exception
    dropped by Python ("Exception ignored in ..."); the interrupt is kept, and the loop raises it
    again at its next step boundary (`raise_pending`)."""

    def __init__(
        self, grace: float = KILL_GRACE, on_signal: Callable[[], None] | None = None
    ) -> None:
        self.grace, self.on_signal = grace, on_signal
        self.pending: Interrupted | None = None

    def raise_pending(self) -> None:
        if self.pending is not None:
            raise self.pending

    def __enter__(self) -> None:
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in self.previous:
            signal.signal(signum, self._raise)

    def _raise(self, signum: int, frame: object) -> None:
        for s in self.previous:  # a second signal must not interrupt the clean-up
            signal.signal(s, signal.SIG_IGN)
        if self.on_signal is not None:
            self.on_signal()
        kill_all(self.grace)
        self.pending = Interrupted(signum)
        raise self.pending

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
