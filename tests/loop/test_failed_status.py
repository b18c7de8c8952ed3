"""A failed run leaves its status (issue 31, item 4).

A checklist the run cannot read (here: not UTF-8, which fails for root too, where chmod 000 does
not) stopped the run with exit 2 and state.json said `failed`, but the status write read the
checklist again, failed, and was reported as "state not saved: .../CHECKLIST.md": status.json
was never written and `ralph-run status` said "no status (never run here?)". Now the status says
`failed` and why, and each warning names the file it is about.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.e2e import make_workspace

pytestmark = pytest.mark.timeout(120)

RALPH = [sys.executable, "-m", "ralph_runner"]
NOT_UTF8 = b"- [ ] caf\xe9\n"  # latin-1: not UTF-8


def ralph(work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RALPH, *args], capture_output=True, text=True, timeout=60, cwd=work)


def runbook(tmp_path: Path, step: str) -> Path:
    path = tmp_path / "runbook.yaml"
    book = {"prompt": "Do {{ item.text }}", "loop": {"steps": [{"shell": step}]}}
    path.write_text(yaml.safe_dump(book, sort_keys=False))
    return path


@pytest.mark.parametrize("when", ["at the start", "after an iteration"])
def test_a_run_stopped_by_an_unreadable_checklist_says_failed_and_why(tmp_path, when):
    """At the start, or when the agent garbled the file during an iteration: either way
    `ralph-run status` shows `failed` and the checklist's error, and no warning blames the
    state for the checklist."""
    work = make_workspace(tmp_path / "work", ["first", "second"])
    checklist = work / "CHECKLIST.md"
    if when == "at the start":
        checklist.write_bytes(NOT_UTF8)
        step = "true"
    else:  # the first iteration's step garbles it: the loop fails reading it for the second
        step = f"printf 'caf\\351\\n' >> {checklist}"
    done = ralph(work, str(runbook(tmp_path, step)))
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert f"{checklist}:" in done.stderr and "not valid UTF-8" in done.stderr, output
    assert "state not saved" not in output, output  # the state was saved; the checklist is bad
    assert "status not saved" not in output, output

    saved = json.loads((work / ".ralph" / "state.json").read_text())
    assert saved["status"] == "failed"
    shown = ralph(work, "status", "--json")
    assert shown.returncode == 0, shown.stderr  # not "no status (never run here?)"
    status = json.loads(shown.stdout)
    assert status["status"] == "failed" and status["running"] is False, status
    assert f"{checklist}:" in status["failure"] and "not valid UTF-8" in status["failure"], status
    human = ralph(work, "status")
    assert human.returncode == 0, human.stderr
    assert "status:     not running (failed)" in human.stdout, human.stdout
    assert f"error:      {checklist}:" in human.stdout, human.stdout
    if when == "at the start":  # never read: no counts made up
        assert "checklist:  not read" in human.stdout, human.stdout
    else:  # the last counts read, and a warning that names the checklist
        assert status["iteration"] == 1 and status["todo"] == 2, status
        assert f"status.json keeps the last checklist counts: {checklist}:" in output, output

    checklist.write_text("- [ ] first\n")  # fixed: the next run clears the error
    again = ralph(work, str(runbook(tmp_path, f"sed -i 's/- \\[ \\]/- [x]/' {checklist}")))
    assert again.returncode == 0, again.stdout + again.stderr
    status = json.loads(ralph(work, "status", "--json").stdout)
    assert status["status"] == "finished" and status["failure"] is None, status
