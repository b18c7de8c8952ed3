"""Kills the commands' process trees within a second of ralph-run's death, even a `kill -9`.

tree_guard_pipe.py starts this once per loop (`python -m ralph_runner.process.tree_guard`, in
its own session) with a pipe as its stdin: `+PID` when a command starts, `-PID` when it ended. Only
ralph-run holds the pipe's other end, so end-of-file means ralph-run is gone. Meanwhile every
command runs with PR_SET_PDEATHSIG = SIGSTOP: when ralph-run dies, the kernel freezes the
command, so its children stay its children (a killed parent would leave them to init, and a
grandchild that moved to a session of its own could no longer be found). Then this freezes every
process of each registered tree: the command, its descendants, and every member of its session
(the command leads its session: children stay members even once orphaned), again until no new
one turns up (a stopped process cannot fork), and kills them all with SIGKILL.

If this process is gone too, the frozen command is still the one `.ralph/running.json`
recorded, with its whole tree under it: the next run kills it (orphans.py).

Linux only, and /proc only (no psutil import): it must start fast and stay small.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

ROUNDS = 20  # looks for new members before the kill (each freezes what it finds)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is ralph-run's to handle
    leaders: dict[int, int] = {}  # pid -> start time (clock ticks since boot)
    pending = b""
    while data := os.read(0, 4096):  # b"": ralph-run is gone
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            _register(line.decode("ascii", "replace").strip(), leaders)
    if leaders:
        _kill(leaders)


def _register(line: str, leaders: dict[int, int]) -> None:
    if len(line) < 2 or not line[1:].isdigit():
        return
    pid = int(line[1:])
    if line[0] == "+":
        start = start_time(pid)
        if start is not None:
            leaders[pid] = start
    elif line[0] == "-":
        leaders.pop(pid, None)


def _kill(leaders: dict[int, int]) -> None:
    """Freeze each tree until it is complete, then kill it whole."""
    me = os.getpid()
    frozen: dict[int, int] = {}  # pid -> start time
    for _ in range(ROUNDS):
        table = _processes()
        children = _children(table)
        found = set()
        for leader, start in leaders.items():
            if table.get(leader, (0, 0, -1))[2] == start:
                found.add(leader)
                found.update(_below(leader, children))
            found.update(pid for pid, (_, sid, _) in table.items() if sid == leader)
        for pid in list(frozen):
            found.update(_below(pid, children))
        new = {pid for pid in found - frozen.keys() if pid != me}
        if not new:
            break
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
            frozen[pid] = table[pid][2]
    for pid in frozen:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, session id, start time) of every live process (zombies left out)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(int(name))
            if fields is not None and fields[0] != "Z":
                table[int(name)] = (int(fields[1]), int(fields[3]), int(fields[19]))
    return table


def start_time(pid: int) -> int | None:
    """When pid started, in clock ticks since boot: fixed for the process's life, unlike a
    wall-clock start time (psutil adds /proc/stat's btime, which moves with the clock)."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, ... starttime."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode("ascii", "replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _children(table: dict[int, tuple[int, int, int]]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    return children


def _below(pid: int, children: dict[int, list[int]]) -> list[int]:
    found, stack = [], list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children.get(child, []))
    return found


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
    sys.exit(0)
