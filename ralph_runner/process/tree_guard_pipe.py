"""ralph-run's end of the tree guard (tree_guard.py): the commands die with ralph-run, even
when it dies by `kill -9`.

Each command is started with PR_SET_PDEATHSIG, a signal the kernel sends it when the *thread*
that forked it ends (`sh` forks in the calling thread, and every caller waits in run() until its
command has ended, so that thread outlives the command): within `tree_guard()` (the loop) it is
SIGSTOP, and the tree guard process kills the frozen tree whole when ralph-run's end of its pipe
closes; outside, it is SIGKILL (which reaches the command only, not its children).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import sh

from ralph_runner.process.kill import kill_tree
from ralph_runner.process.watched import exits_within

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def dies_with(parent: int, guard_fd: int | None) -> Callable[[], None] | None:
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


class TreeGuard:
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
            if not exits_within(process.pid, 5):
                kill_tree(process.pid)
            process.wait()


guard = TreeGuard()


@contextlib.contextmanager
def tree_guard() -> Iterator[None]:
    """Within this block, a kill -9 of this process takes the commands' trees with it
    (within a second: see tree_guard.py); the loop runs in it."""
    guard.start()
    try:
        yield
    finally:
        guard.stop()
