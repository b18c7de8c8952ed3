"""status.json through its one module: what the loop writes reads back as it was, and a file
an older, partial or newer ralph-run wrote reads as a whole `Status`, never a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import FatalError
from ralph_runner.workspace import status_file
from ralph_runner.workspace.status_file import Status

RUNNING: Status = {
    "status": "running",
    "pid": 4242,
    "running": True,
    "iteration": 7,
    "item": "add the parser",
    "phase": "agent",
    "done": 3,
    "todo": 2,
    "skipped": 1,
    "chars": 120,
    "lines": 6,
    "deaths": 1,
    "last_death": {
        "death": 1,
        "time": "2026-01-02T03:04:05+00:00",
        "phase": "during-step",
        "item": "add the parser",
        "reason": "connection refused",
        "fault": "process-exit",
    },
    "last_start": {
        "time": "2026-01-02T03:00:00+00:00",
        "recovered": True,
        "seconds": 4.2,
        "reason": None,
    },
    "agent_broken": None,
    "limited_until": 1767323045.0,
    "limited": {
        "item": "add the parser",
        "source": "agent",
        "line": "usage limit reached",
        "reset_at": 1767323000.0,
        "until": 1767323045.0,
    },
    "failure": None,
    "paused": False,
    "pause": {
        "state": "pausing",
        "since": None,
        "requested": 1767322000.5,
        "now": True,
        "by": "ops@host",
        "killed_step": None,
        "steps": None,
        "steps_error": None,
    },
    "step_started": 1767322990.25,
    "attempts": 1,
    "hang_bound": {"seconds": 41.5, "why": "stall_after"},
    "updated": 1767323000.0,
    "workdir": "/srv/work",
}


def test_what_the_loop_writes_reads_back_as_it_was(tmp_path: Path) -> None:
    status_file.write(tmp_path, RUNNING)
    assert status_file.path(tmp_path) == tmp_path / ".ralph" / "status.json"
    assert json.loads(status_file.path(tmp_path).read_text()) == RUNNING
    assert status_file.read(tmp_path) == RUNNING


def test_secrets_are_masked_in_keys_and_values(tmp_path: Path) -> None:
    status_file.write(tmp_path, {**RUNNING, "item": "use hunter22 now"}, Redactor(["hunter22"]))
    found = status_file.read(tmp_path)
    assert found is not None and found["item"] == "use **** now"


def test_no_file_is_none_and_a_file_that_is_no_object_is_an_error(tmp_path: Path) -> None:
    assert status_file.read(tmp_path) is None
    status_file.path(tmp_path).parent.mkdir()
    status_file.path(tmp_path).write_text("[1]")
    with pytest.raises(FatalError, match=r"expected a JSON object; delete .* to start over"):
        status_file.read(tmp_path)
    status_file.path(tmp_path).write_text("{")
    with pytest.raises(FatalError, match=r"delete .* to start over"):
        status_file.read(tmp_path)


def test_a_partial_file_reads_with_the_defaults_of_a_loop_that_never_ran(tmp_path: Path) -> None:
    """The keys it lacks read as 0, False, None or ""; the checklist's counts stay absent (not
    read yet) unless the file has them."""
    status_file.path(tmp_path).parent.mkdir()
    status_file.path(tmp_path).write_text(json.dumps({"running": True, "iteration": 30}))
    found = status_file.read(tmp_path)
    assert found is not None
    assert (found["running"], found["iteration"], found["deaths"]) == (True, 30, 0)
    assert (found["pid"], found["last_death"], found["pause"], found["hang_bound"]) == (
        (None, None, None, None)
    )
    assert (found["status"], found["paused"], found["updated"]) == ("", False, 0.0)
    assert "done" not in found and "crash" not in found


def test_an_older_or_newer_file_keeps_what_it_says(tmp_path: Path) -> None:
    """A record lacking a key a later version added reads with that key's default; an ill-typed
    value reads as the default; a key this version does not know is kept (`status --json`)."""
    older = {
        **RUNNING,
        "last_death": {"death": 2, "time": "t", "phase": "before-iteration", "reason": "down"},
        "pid": "4242",  # ill-typed
        "done": True,  # a bool is no count
        "hang_bound": {"seconds": "soon"},
        "from_a_newer_version": {"x": 1},
    }
    status_file.path(tmp_path).parent.mkdir()
    status_file.path(tmp_path).write_text(json.dumps(older))
    found = status_file.read(tmp_path)
    assert found is not None
    assert found["last_death"] == {
        "death": 2, "time": "t", "phase": "before-iteration", "item": None, "reason": "down",
        "fault": "",
    }  # fmt: skip
    assert found["pid"] is None and "done" not in found
    assert found["hang_bound"] == {"seconds": 0.0, "why": ""}
    assert (found["from_a_newer_version"], found["todo"]) == ({"x": 1}, 2)
    assert found["limited"] == RUNNING["limited"]
