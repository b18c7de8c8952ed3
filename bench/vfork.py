"""`python bench/vfork.py ARGS...`: ralph-run with one part swapped, for the loop row only.

What sh costs the loop: the same ralph-run, runbook and agent, with execute's process start
replaced by the standard library's `subprocess.Popen`, which starts a command with vfork (no
copy of the interpreter's memory) where sh 2.x always forks it. Every fork copies the page
tables of ralph-run's ~35 MiB heap, waits for the child to tear them down at exec, and leaves
the parent to re-fault every page it writes afterwards; vfork does none of that.

A measurement, not a product path: the swap has no PR_SET_PDEATHSIG and no tree guard
registration, so a kill -9 of this process could leave its commands running.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ralph_runner import cli
from ralph_runner.process import execute, registry


class _Process:
    def __init__(self) -> None:
        self.exit_code: int | None = None


class _Command:
    """What execute.py reads of a started sh command: pid, wait(), process.exit_code."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen, self.pid, self.process = popen, popen.pid, _Process()

    def wait(self) -> int:
        self.process.exit_code = self.popen.wait()
        return self.process.exit_code


def _start(program, args, cwd, env, stdin, lifeline, output):
    source = subprocess.PIPE if stdin is not None else lifeline[0] if lifeline else None
    with registry.lock:
        popen = subprocess.Popen(
            [program, *args],
            cwd=cwd,
            env=env,
            stdin=source if source is not None else subprocess.DEVNULL,
            stdout=output,  # execute.run reads the pipe, as it does for sh
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if stdin is not None and popen.stdin is not None:
            popen.stdin.write(stdin.encode())
            popen.stdin.close()
        running = registry.add(_Command(popen))  # type: ignore[arg-type]
        registry.changed()
    return running


if __name__ == "__main__":
    execute._start = _start  # type: ignore[assignment]
    raise SystemExit(cli.main(sys.argv[1:]))
