"""SIGINT and SIGTERM during a run: the commands' trees killed, then Interrupted raised in the
main thread, so that the run saves its state on the way out. SIGHUP is no stop: the run goes on."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from ralph_runner.errors import Interrupted
from ralph_runner.process.kill import KILL_GRACE
from ralph_runner.process.registry import kill_all


class InterruptsRaise:
    """SIGINT/SIGTERM: every running command's tree is killed (TERM, `grace` s, KILL), then
    Interrupted is raised in the main thread, so `finally` blocks save state. `on_signal` runs
    first (the fleet stops starting hosts).

    A handler that happens to run inside a weakref callback or a `__del__` has its exception
    dropped by Python ("Exception ignored in ..."); the interrupt is kept, and the loop raises it
    again at its next step boundary (`raise_pending`).

    A process forked from the run (`sh` forks in Python, then runs its pre-exec code) inherits
    the handler until it execs: a signal there ends that process at once with the signal's exit
    status, for an Interrupted raised in it would run the parent's clean-up in a copy of it (`sh`
    catches only Exception there): a copy of the run that marked it crashed."""

    def __init__(
        self, grace: float = KILL_GRACE, on_signal: Callable[[], None] | None = None
    ) -> None:
        self.grace, self.on_signal = grace, on_signal
        self.pending: Interrupted | None = None

    def raise_pending(self) -> None:
        if self.pending is not None:
            raise self.pending

    def __enter__(self) -> None:
        self.owner = os.getpid()
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for signum in self.previous:
            signal.signal(signum, self._raise)
        self.previous_hangup = signal.signal(signal.SIGHUP, _hung_up)

    def _raise(self, signum: int, frame: object) -> None:
        if os.getpid() != self.owner:  # a fork of the run, before its exec
            os._exit(128 + signum)
        for s in self.previous:  # a second signal must not interrupt the clean-up
            signal.signal(s, signal.SIG_IGN)
        # pending before the kill: a thread whose step the kill ends sees the interrupt, not a
        # failed step to charge to its item
        self.pending = Interrupted(signum)
        if self.on_signal is not None:
            self.on_signal()
        kill_all(self.grace)
        raise self.pending

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        signal.signal(signal.SIGHUP, self.previous_hangup)


def _hung_up(signum: int, frame: object) -> None:
    """SIGHUP: the terminal went away (a dropped ssh or tmux session), not the operator asking
    to stop. The run goes on, as under nohup; the console detaches at its next write (EIO).
    A handler, not SIG_IGN: the commands the run starts get the default back at exec."""
