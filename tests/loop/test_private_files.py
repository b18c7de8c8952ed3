"""ralph-run's own files are its own (issue 29, finding 11): `.ralph/running.json` and the lock
were opened through symlinks, so whoever could plant one chose the pids the next run killed (and
which file it truncated); `.ralph/` and the death logs were world-readable though they hold
server logs. Now a planted symlink is refused (exit 2, named), never followed; `.ralph/` is
0700 (an older one is narrowed), and the files ralph-run creates are 0600."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.e2e import AGENT_STEP, Scenario
from support.standin import python_env

from ralph_runner.process import tree_guard

pytestmark = pytest.mark.timeout(120)


def _run(scenario: Scenario) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ralph_runner", str(scenario.runbook_path), "--json"]
    return subprocess.run(
        [*command, "-e", json.dumps(scenario.facts)],
        cwd=scenario.workspace,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.parametrize("name", ["running.json", "lock"])
def test_a_planted_symlink_among_its_files_is_refused(
    scenario: Scenario, tmp_path: Path, name: str
) -> None:
    """The attack: running.json pointing at a record of a process that is not the run's (its
    pid and start time right), so the next run would kill it; the lock pointing at a file of
    the operator's, which opening it with O_TRUNC (running.json) would have emptied."""
    scenario.prepare(["one item"])
    victim = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        elsewhere = tmp_path / "elsewhere.json"
        record = [{"pid": victim.pid, "started": tree_guard.start_time(victim.pid)}]
        elsewhere.write_text(json.dumps(record))
        state = scenario.workspace / ".ralph"
        state.mkdir()
        (state / name).symlink_to(elsewhere)

        done = _run(scenario)

        assert done.returncode == 2, done.stderr
        assert f"{state / name}" in done.stderr and "symlink" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert victim.poll() is None, "the recorded process was killed"
        assert json.loads(elsewhere.read_text()) == record  # neither truncated nor written
        assert (state / name).is_symlink()
    finally:
        victim.kill()
        victim.wait()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_its_directory_is_0700_and_its_files_0600(scenario: Scenario) -> None:
    scenario.prepare(["one item", "two items"])
    state = scenario.workspace / ".ralph"
    state.mkdir(mode=0o755)  # as an older ralph-run left it
    os.chmod(state, 0o755)
    run = scenario.start()
    run.wait_status(lambda s: s.get("phase") == AGENT_STEP, "the agent step")
    scenario.standin.trigger(die=True)  # a death: the death log and its records are written
    assert run.wait(90) == 0, run.stderr

    assert _mode(state) == 0o700
    written = [
        state / "state.json",
        state / "status.json",
        state / "iterations.jsonl",
        state / "lock",
        scenario.workspace / "logs" / "deaths.log",
        scenario.workspace / "logs" / "deaths.jsonl",
        *sorted((state / "recorder").glob("*.jsonl")),
    ]
    modes = {str(path.relative_to(scenario.workspace)): oct(_mode(path)) for path in written}
    assert set(modes.values()) == {oct(0o600)}, modes
