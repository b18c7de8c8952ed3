"""Process trees left by a run killed with -9: recorded while they run, cleared on the next run.

Every command runs in its own session, so a SIGKILLed ralph-run cannot take its agent down
with it. While a loop runs, `.ralph/running.json` lists the running commands (pid + start
time, so a recycled pid is never hit); the next run on the workdir kills what is left.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import psutil

from ralph_runner import execute

FILE = "running.json"


@contextlib.contextmanager
def recorded(state_dir: Path) -> Iterator[None]:
    """Clear the orphans of an earlier run, then record ours until the block ends."""
    path = state_dir / FILE
    clear(path)
    execute.on_running_change(lambda pids: _write(path, pids))
    try:
        yield
    finally:
        execute.on_running_change(None)
        path.unlink(missing_ok=True)


def clear(path: Path) -> None:
    """Kill every recorded process tree that is still the one recorded."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for entry in entries:
        try:
            alive = psutil.Process(entry["pid"]).create_time() == entry["started"]
        except (psutil.Error, KeyError, TypeError):
            continue
        if alive:
            execute.kill_tree(entry["pid"])


def _write(path: Path, pids: list[int]) -> None:
    entries = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            entries.append({"pid": pid, "started": psutil.Process(pid).create_time()})
    temp = path.with_suffix(".tmp")
    with contextlib.suppress(OSError):  # best effort: never fail a command for this
        temp.write_text(json.dumps(entries))
        temp.replace(path)
