"""Process trees left by a run killed with -9: recorded while they run, cleared on the next run.

Every command runs in its own session, so a SIGKILLed ralph-run cannot take its agent down
with it. While a loop runs, `.ralph/running.json` lists the running commands (pid + start
time in clock ticks since boot, so a recycled pid is never hit); the next run on the workdir
kills what is left.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ralph_runner.process import registry, tree_guard
from ralph_runner.process.kill import kill_tree
from ralph_runner.process.private_dir import open_private

FILE = "running.json"


@contextlib.contextmanager
def recorded(state_dir: Path) -> Iterator[None]:
    """Clear the orphans of an earlier run, then record ours until the block ends."""
    path = state_dir / FILE
    clear(path)
    try:
        record: _Record | None = _Record(path)
    except OSError:  # best effort: the tree guard remains
        record = None
    registry.on_running_change(record.write if record else None)
    try:
        yield
    finally:
        registry.on_running_change(None)
        if record is not None:
            record.close()
            path.unlink(missing_ok=True)


def clear(path: Path) -> None:
    """Kill every recorded process tree that is still the one recorded. The file is read only
    when it is a file of ours, not a symlink (FatalError): a planted one would choose the pids."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with os.fdopen(fd, "rb") as file:
            entries = json.loads(file.read())
    except (OSError, ValueError):
        return
    for entry in entries if isinstance(entries, list) else []:
        pid = entry.get("pid") if isinstance(entry, dict) else None
        if isinstance(pid, int) and pid > 0 and tree_guard.start_time(pid) == entry.get("started"):
            kill_tree(pid)


class _Record:
    """The file, rewritten in place by one pwrite per change (a command starts once per step:
    this is on the loop's hot path). Padding with spaces to the longest record so far keeps it
    one valid JSON document after any write, and a kill -9 cannot split a single write.
    Nothing is fsynced: a power cut leaves no process to clear."""

    def __init__(self, path: Path) -> None:
        self.fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        self.size = 0

    def write(self, pids: list[int]) -> None:
        starts = [(pid, tree_guard.start_time(pid)) for pid in pids]
        entries = [{"pid": pid, "started": at} for pid, at in starts if at is not None]
        data = json.dumps(entries).encode("ascii")
        data += b" " * (self.size - len(data))
        with contextlib.suppress(OSError):  # best effort: never fail a command for this
            os.pwrite(self.fd, data, 0)
            self.size = len(data)

    def close(self) -> None:
        os.close(self.fd)
