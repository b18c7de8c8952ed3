"""Killing a command's whole process tree: its process group and every descendant psutil can
see (grandchildren that moved to their own group or session included), TERM first, then KILL;
never ralph-run itself, its group or its ancestors."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

import psutil

KILL_GRACE = 2.0  # seconds between TERM and KILL
_GONE_POLL = 0.01  # seconds between looks at a killed tree


def kill_tree(pid: int, grace: float = KILL_GRACE) -> None:
    """Kill pid's process group and every descendant: TERM, up to `grace` s, then KILL."""
    kill_trees([pid], grace)


def kill_trees(pids: Iterable[int], grace: float) -> None:
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
