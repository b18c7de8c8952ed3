"""The errors an operator can act on, each with its exit code: caught once, at the top, in cli.py.

`ExitCode` names every exit code ralph-run has. `FatalError` (with `Problem`s: file, line,
column, key path) and its kinds `GaveUp`, `AgentBrokenError` and `LimitedError`; `Interrupted` for
SIGINT/SIGTERM. Anything else is a bug (crash.py).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import IntEnum


class ExitCode(IntEnum):
    """Every exit code of ralph-run, in one place (docs: contract, troubleshooting)."""

    DONE = 0  # the checklist is finished (and `status`, `pause`, `probe`: all went well)
    PARTIAL = 1  # an operator command did not do all it was asked: no status, a host unreached
    INVALID = 2  # a wrong runbook, inventory or argument
    HELD = 3  # another ralph-run holds this workdir
    GAVE_UP = 4  # the service could not be recovered (recovery.exit_code's default)
    MAX_ITERATIONS = 5  # stopped at max_iterations with items left
    AGENT_BROKEN = 6  # the agent failed the same way on consecutive items
    LIMITED = 7  # a usage limit resets later than limits.max_wait (limits.exit_code's default)
    INTERNAL = 70  # a bug in ralph-run (EX_SOFTWARE in sysexits.h)
    SIGINT = 130  # 128 + the signal: state saved
    SIGTERM = 143


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input, and exactly where it is."""

    message: str
    file: str | None = None
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    path: str = ""  # key path, e.g. "loop.steps[1].shell"

    def __str__(self) -> str:
        where = ":".join(str(p) for p in (self.file, self.line, self.column) if p is not None)
        parts = [p for p in (where, self.path) if p]
        return ": ".join([*parts, self.message])


class FatalError(Exception):
    """An error the operator must fix; carries one or more problems and the exit code."""

    def __init__(
        self, problems: Problem | str | list[Problem], exit_code: int = ExitCode.INVALID
    ) -> None:
        if isinstance(problems, str):
            problems = Problem(problems)
        self.problems: list[Problem] = problems if isinstance(problems, list) else [problems]
        self.exit_code = exit_code
        super().__init__("\n".join(str(p) for p in self.problems))


class GaveUp(FatalError):
    """The service could not be brought back: the loop stops with recovery.exit_code."""


class AgentBrokenError(FatalError):
    """The agent failed the same way on consecutive items while the service was healthy."""


class LimitedError(FatalError):
    """The agent's usage limit resets later than `limits.max_wait`: the loop stops with
    `limits.exit_code` (7) and says when to come back (loop/limits.py)."""


class Interrupted(BaseException):
    """SIGINT/SIGTERM. A BaseException, like KeyboardInterrupt, so that no `except Exception`
    (a template's error handler, a probe's) turns the signal into an ordinary failure. The CLI
    exits with its exit_code (128 + the signal)."""

    def __init__(self, signum: int) -> None:
        self.exit_code = 128 + signum
        super().__init__(signal.Signals(signum).name)


def key_path(path: tuple[str | int, ...]) -> str:
    """Render ("loop", "steps", 1, "shell") as "loop.steps[1].shell"."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
