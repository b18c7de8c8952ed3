"""The catch-all (issue 11, defect 6): a bug in ralph-run prints one line, writes a crash file
with the traceback and versions, marks the run `crashed` and exits 70, never a bare traceback.

The internal error is real: a real ralph-run process runs a real loop with one more action kind
(tests/data/plugins/broken_action.py) whose code raises, as a broken plugin would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from support.e2e import make_workspace
from support.standin import python_env

from ralph_runner.errors import ExitCode

BROKEN = Path(__file__).parents[1] / "data" / "plugins" / "broken_action.py"
SECRET = "hunter2-the-api-key"


def _runbook(path: Path) -> Path:
    runbook = path / "runbook.yaml"
    document = {
        "vars": {"api_key": SECRET},
        "secrets": ["api_key"],
        "loop": {"steps": [{"name": "explode", "boom": "key={{ api_key }}"}]},
    }
    runbook.write_text(yaml.safe_dump(document))
    return runbook


def _ralph(workdir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BROKEN), *args],
        cwd=workdir,
        env=python_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _crash_file(stderr: str) -> Path:
    (line,) = [ln for ln in stderr.splitlines() if "the traceback and versions are in" in ln]
    return Path(line.rsplit(" ", 1)[1])


def test_a_crash_in_a_run_is_one_line_a_crash_file_and_a_crashed_status(tmp_path: Path) -> None:
    workdir = make_workspace(tmp_path / "work", ["one item"])
    done = _ralph(workdir, str(_runbook(tmp_path)))

    assert done.returncode == ExitCode.INTERNAL == 70, done.stderr
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    first = done.stderr.splitlines()[0]
    assert (
        first
        == "ralph-run: internal error: RuntimeError: the boom action broke on key=**** second line"
    )
    path = _crash_file(done.stderr)
    assert path.parent == workdir / ".ralph" and path.name.startswith("crash-")
    report = path.read_text()
    assert "Traceback (most recent call last)" in report and "broken_action.py" in report
    for field in ("ralph-run: 0.", "python: 3.", "platform: ", "argv: ['ralph-run', "):
        assert field in report, field
    status = json.loads((workdir / ".ralph" / "status.json").read_text())
    assert status["status"] == "crashed" and status["running"] is False
    assert json.loads((workdir / ".ralph" / "state.json").read_text())["status"] == "crashed"
    for text in (done.stderr, done.stdout, report, json.dumps(status)):
        assert SECRET not in text

    shown = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "status", str(workdir)],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "not running (crashed)" in shown.stdout, shown.stdout


def test_a_crash_outside_a_run_writes_its_file_in_the_temp_directory(tmp_path: Path) -> None:
    workdir = make_workspace(tmp_path / "work", ["one item"])
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = _ralph(
        workdir, str(_runbook(tmp_path)), "--check", BOOM_IN_DESCRIBE="1", TMPDIR=str(temp)
    )

    assert done.returncode == 70, done.stderr
    assert "Traceback" not in done.stderr
    (path,) = temp.glob("ralph-run-crash-*.txt")
    assert _crash_file(done.stderr) == path
    assert "RuntimeError: the boom action broke on key=****" in path.read_text()
    assert SECRET not in path.read_text() + done.stderr
    assert not (workdir / ".ralph").exists(), "--check writes nothing in the workdir"


def test_exit_70_is_documented() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "--help"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "70 internal error" in done.stdout
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "| 70 | internal error" in readme
