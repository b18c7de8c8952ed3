"""What a step leaves running when it ends is killed: a dev server an agent backgrounded with
`&`, a double-forked daemon, a child that moved to a session of its own with `setsid`.

"The step's processes" are every process started, directly or not, by a command the step ran:
each such command gets a marker in its environment (RALPH_RUN_STEP=<a token of the step's own>),
which every descendant inherits across forks, double forks, `setsid` and re-parenting to init
or a subreaper; and each command leads a session of its own, whose members keep its session id
even once orphaned (a descendant that cleared its environment is still found this way, unless it
also left the session). When the step ends, whatever still carries its marker or belongs to one
of its sessions is killed (TERM, then KILL), this process and its ancestors never.

Only for the steps that ask (`swept()`: the loop's agent steps); a recovery or setup step
starts services that must outlive it. Local commands only: an ssh host's leftovers are on it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from ralph_runner.process.kill import KILL_GRACE, kill_trees, lineage

MARKER = "RALPH_RUN_STEP"
_local = threading.local()  # the sweep of the step this thread runs, if any


@dataclass
class Sweep:
    """One step's sweep: its marker, the sessions its commands led, and what was killed
    (`name (pid N)`), filled when the step ends."""

    token: str = field(default_factory=lambda: secrets.token_hex(8))
    sessions: set[int] = field(default_factory=set)
    killed: list[str] = field(default_factory=list)


@contextlib.contextmanager
def swept(grace: float = KILL_GRACE) -> Iterator[Sweep]:
    """Commands this thread starts inside the block are the step's; at its end, what they left
    running is killed, and the Sweep says what that was."""
    sweep = Sweep()
    outer, _local.sweep = getattr(_local, "sweep", None), sweep
    try:
        yield sweep
    finally:
        _local.sweep = outer
        if sweep.sessions:  # a step that started no command left nothing
            found = left_behind(sweep)
            sweep.killed = [f"{name} (pid {pid})" for pid, name in found]
            kill_trees([pid for pid, _ in found], grace)


def marker() -> dict[str, str]:
    """The environment a command started now gets: the marker of this thread's sweep, if any."""
    sweep: Sweep | None = getattr(_local, "sweep", None)
    return {MARKER: sweep.token} if sweep is not None else {}


def started(pid: int) -> None:
    """A command started in this thread (the leader of its own session)."""
    sweep: Sweep | None = getattr(_local, "sweep", None)
    if sweep is not None:
        sweep.sessions.add(pid)


def left_behind(sweep: Sweep) -> list[tuple[int, str]]:
    """(pid, name) of the live processes that carry the sweep's marker or belong to one of its
    sessions; /proc only (a process of another user cannot be read, and is none of ours)."""
    needle = f"{MARKER}={sweep.token}".encode()
    spared = lineage()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spared:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat", "rb") as file:
                stat = file.read()
            name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode("utf-8", "replace")
            fields = stat[stat.rindex(b")") + 2 :].split()
            state, session = fields[0], int(fields[3])
            if state == b"Z":  # a zombie: already gone, its parent has yet to reap it
                continue
            if session not in sweep.sessions:
                with open(f"/proc/{pid}/environ", "rb") as file:
                    if b"\0" + needle + b"\0" not in b"\0" + file.read() + b"\0":
                        continue
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile, or it is not ours to read
        found.append((pid, name))
    return found
