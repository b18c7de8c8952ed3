"""The names of ralph-run's own files in a workdir, declared once: `.ralph/` and the files of it
that more than one package reads or writes; and how its JSON files are written and read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ralph_runner.durable.files import write_atomic
from ralph_runner.durable.json_value import JSON
from ralph_runner.errors import FatalError, Problem

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ralph_runner.durable.redaction import Redactor

STATE_DIR = ".ralph"
# The files of .ralph/ that more than one module reads or writes, named here once: the run's
# state (loop/state.py; `top` reads it), the iteration history (deaths/history.py) and where
# the death records are (deaths/wiring.py). status.json: workspace/status_file.py.
STATE_FILE = "state.json"
HISTORY_FILE = "iterations.jsonl"
SOURCES_FILE = "sources.json"


def write_json(
    path: Path, data: Mapping[str, object], redactor: Redactor | None, *, durable: bool
) -> None:
    """Replace a JSON file of .ralph/ atomically (readers and a kill -9 see the old or the new
    one), fsynced when `durable`; secrets masked, keys too (the state keeps strikes by item
    text). FatalError naming the file when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FatalError(Problem(f"cannot create: {e.strerror}", str(path.parent))) from None
    shown = redactor.data(data, keys=True) if redactor is not None else data
    text = json.dumps(shown, ensure_ascii=False, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text.encode("utf-8"), durable=durable, follow=False)


def read_json(path: Path, what: str) -> JSON:
    """A JSON file of .ralph/; None when there is none. FatalError when it cannot be read or
    parsed, saying how to start over (and that its `what` would be lost)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise corrupt(path, str(e), what) from None
    try:
        data: JSON = json.loads(text)
    except json.JSONDecodeError as e:
        problem = Problem(f"{e.msg}; {_reset_hint(path, what)}", str(path), e.lineno, e.colno)
        raise FatalError(problem) from None
    return data


def corrupt(path: Path, why: str, what: str) -> FatalError:
    """A file of .ralph/ that holds no usable content, and how to start over."""
    return FatalError(Problem(f"{why}; {_reset_hint(path, what)}", str(path)))


def _reset_hint(path: Path, what: str) -> str:
    return f"delete {path} to start over (its {what} will be lost)"
