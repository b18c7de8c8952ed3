"""Internal errors, handled once at the top (as pre-commit's error handler does).

An exception nobody expected is a bug in ralph-run, not in the runbook: the operator gets one
line saying so, and a crash file with the traceback and the versions to attach to a bug report.
A run registers its state directory (`register`), so that its crash file lies beside its state
and its status says `crashed` instead of a `running` that nothing runs. Everything written is
masked with the run's secrets.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import ExitCode
from ralph_runner.loop.state import Store, move
from ralph_runner.workspace import status_file

STATUS = "crashed"
SAYS_CAUSE = "ralph-run: internal error: "  # the lines `report` prints (`top` reads them)
SAYS_FILE = "ralph-run: the traceback and versions are in "


@dataclass
class _Run:
    store: Store | None
    redactor: Redactor


_registered = _Run(None, Redactor([]))


def register(store: Store | None = None, redactor: Redactor | None = None) -> None:
    """What a crash from now on must mark and mask: the run's store, its secrets."""
    _registered.store = store or _registered.store
    _registered.redactor = redactor or _registered.redactor


def mask(text: str) -> str:
    """Text masked with the secrets registered so far (at least credential-shaped tokens)."""
    return _registered.redactor.text(text)


def report(exc: BaseException, argv: list[str]) -> int:
    """Print one line, write the crash file, mark the run crashed; the exit code to use."""
    mask = _registered.redactor.text
    cause = " ".join(f"{type(exc).__name__}: {exc}".split())
    print(f"{SAYS_CAUSE}{mask(cause)}", file=sys.stderr)
    details = mask(_details(exc, argv))
    try:
        path = _write(details)
    except OSError as err:
        print(f"ralph-run: could not write a crash file ({err}); the details:", file=sys.stderr)
        print(details, file=sys.stderr)
    else:
        print(f"{SAYS_FILE}{path}", file=sys.stderr)
    _mark_crashed(cause)
    print(
        "ralph-run: this is a bug in ralph-run; please report it with that file.", file=sys.stderr
    )
    return ExitCode.INTERNAL


def _details(exc: BaseException, argv: list[str]) -> str:
    return "\n".join(
        [
            f"ralph-run internal error at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}",
            f"ralph-run: {_version()}",
            f"python: {sys.version.split()[0]} ({sys.executable})",
            f"platform: {platform.platform()}",
            f"argv: {['ralph-run', *argv]}",
            f"cwd: {os.getcwd()}",
            "",
            "".join(traceback.format_exception(exc)),
        ]
    )


def _version() -> str:
    try:
        return metadata.version("ralph-run")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _write(details: str) -> Path:
    """`.ralph/crash-<time>.txt` of the run, else one in the temp directory; never replaced."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    store = _registered.store
    if store is not None:
        path = store.dir / f"crash-{stamp}-{os.getpid()}.txt"
    else:
        path = Path(tempfile.gettempdir()) / f"ralph-run-crash-{stamp}-{os.getpid()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as out:
        out.write(details)
    return path


def _mark_crashed(cause: str) -> None:
    """The run's state and status say `crashed` (the next run resumes, as after a kill)."""
    store = _registered.store
    if store is None:
        return
    try:
        state = store.load()
        if state.status == "running":  # the loop marks its own crash; this one came past it
            move(state, STATUS)
            store.save(state)
        if state.status != STATUS:
            return  # it crashed before the run began: that status still says what happened
        status = store.read_status() or status_file.parse({}, store.status_path)
        store.write_status({**status, "status": STATUS, "running": False, "crash": cause})
    except Exception as err:  # a crash in the crash handler must not hide the first one
        print(f"ralph-run: warning: status not saved as crashed: {err}", file=sys.stderr)
