"""`ralph-run demo --dir DIR`: it deletes what DIR holds, so only a folder it may take is taken.

A new or empty folder, or one an earlier demo made (its marker file), is the demo's; any other
folder with something in it is refused with exit 2, one line, nothing deleted and nothing
started (issue 31, item 1: `--dir .` deleted a project's files).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.e2e import processes_in
from support.standin import StandIn, python_env, wait_for

from ralph_runner.commands.demo import MARKER

pytestmark = pytest.mark.timeout(120)


def demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", "demo", *args],
        cwd=cwd,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=80,
    )


def listing(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): path.read_text() if path.is_file() else "/"
        for path in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize("given", ["path", "."])
def test_a_folder_the_demo_did_not_make_is_refused(tmp_path: Path, given: str) -> None:
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "keep.txt").write_text("mine\n")
    (project / "src" / "main.py").write_text("print('hello')\n")
    before = listing(project)

    done = demo("--dir", str(project) if given == "path" else ".", cwd=project)

    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"ralph-run: error: demo: {project} is not empty"), line
    assert "new or empty folder" in line
    assert done.stdout == ""
    assert listing(project) == before  # keep.txt and all: nothing deleted, nothing written
    assert processes_in(project) == []  # no stand-in server started, none left running


def test_a_file_is_refused(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    done = demo("--dir", str(notes), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        done.stderr
        == f"ralph-run: error: demo: {notes} is not a folder: give --dir a new or empty folder\n"
    )
    assert notes.read_text() == "mine\n"


def started(workspace: Path) -> subprocess.Popen[str]:
    """The real demo in `workspace`, until its loop runs the first iteration; then SIGINT (the
    loop saves its state and the demo stops its stand-in), so that no full demo is needed."""
    status = workspace / ".ralph" / "status.json"  # an earlier demo's may still be there
    since = time.time_ns()
    process = subprocess.Popen(
        [sys.executable, "-m", "ralph_runner", "demo", "--dir", str(workspace)],
        cwd=workspace.parent,
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def iterating() -> bool:
        assert process.poll() is None, process.communicate()
        try:
            fresh = status.stat().st_mtime_ns >= since
            return fresh and json.loads(status.read_text()).get("iteration", 0) >= 1
        except (FileNotFoundError, json.JSONDecodeError):
            return False

    try:
        wait_for(iterating, 60, "the demo's first iteration")
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    return process


def test_a_folder_an_earlier_demo_made_is_made_again(tmp_path: Path) -> None:
    """A first demo, stopped in its first iteration, leaves its marker; a second, whole demo in
    the same folder takes it, deletes what the first left and recovers its two deaths."""
    workspace = tmp_path / "demo"
    try:
        first = started(workspace)
        assert first.returncode == 130
        assert (workspace / MARKER).is_file()
        assert MARKER in (workspace / ".gitignore").read_text()
        (workspace / "left-over.txt").write_text("from the first demo\n")

        second = demo("--dir", str(workspace), cwd=tmp_path)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "total: 2 deaths, 2 recovered" in second.stdout
        assert not (workspace / "left-over.txt").exists()
        assert (workspace / MARKER).is_file() and (workspace / "report.html").is_file()
    finally:
        servers = StandIn(workspace / ".standin")  # only to find and stop the demo's servers
        left = servers.processes()
        servers.stop()
    assert left == []
    assert processes_in(workspace) == []
