"""The commands running now, so that a shutdown (kill_all) reaches every one of their trees,
and a run killed with -9 leaves a record of them for its successor (orphans.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psutil
import sh

from ralph_runner.process.kill import KILL_GRACE, kill_tree, kill_trees


class Running:
    """One started command, as the registry (and kill_all) sees it."""

    def __init__(self, command: sh.RunningCommand) -> None:
        self.command = command
        self.pid: int = command.pid
        self.killed_by_shutdown = False


_running: dict[int, Running] = {}
_on_change: Callable[[list[int]], None] | None = None
# Re-entrant: kill_all runs from a signal handler, possibly while the same (main) thread is
# inside run() holding this lock.
lock = threading.RLock()


def add(command: sh.RunningCommand) -> Running:
    """Register a command that has just started (the caller holds `lock` around its start)."""
    with lock:
        running = Running(command)
        _running[running.pid] = running
    return running


def remove(pid: int) -> None:
    """Forget a command that ended. No `changed()`: a dead pid in the record is harmless (its
    start time no longer matches), and it saves a write per command."""
    with lock:
        _running.pop(pid, None)


def on_running_change(callback: Callable[[list[int]], None] | None) -> None:
    """Tell `callback` the pids of the running commands whenever one starts, so a run killed
    with -9 leaves a record of the process trees its successor must clear away."""
    global _on_change
    _on_change = callback


def changed() -> None:
    """A command started: tell the `on_running_change` callback."""
    if _on_change is not None:
        _on_change(list(_running))


def kill_all(grace: float = KILL_GRACE) -> None:
    """Kill the trees of every command still running (ralph-run's SIGTERM/SIGINT path)."""
    with lock:
        victims = list(_running.values())
        for running in victims:
            running.killed_by_shutdown = True
    kill_trees([running.pid for running in victims], grace)


def kill_unregistered_children() -> None:
    """Kill the trees of our children that the registry does not know: every process we start
    is registered as soon as it exists, so an unknown child was caught mid-spawn."""
    for child in psutil.Process().children():
        if child.pid not in _running:
            kill_tree(child.pid)
