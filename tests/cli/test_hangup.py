"""A loop outlives its audience (issue 29, finding 10): `ralph-run ... | head -3` ended the run
with exit 141 and status `crashed`, and a SIGHUP (a dropped ssh or tmux session) ended it
without saving state. Now the console detaches and the loop finishes its checklist: through a
closed pipe, after a SIGHUP, and in a tmux pane whose terminal is destroyed under it."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
from support.e2e import RalphRun, Scenario
from support.standin import python_env, wait_for
from top_helpers import Pane

pytestmark = pytest.mark.timeout(150)

ITEMS = ["first item", "second item", "third item"]


def _command(scenario: Scenario) -> list[str]:
    """The loop with the human console, as an operator starts it."""
    facts = json.dumps(scenario.facts)
    return [sys.executable, "-m", "ralph_runner", str(scenario.runbook_path), "-e", facts]


def _finished(scenario: Scenario) -> None:
    status = json.loads((scenario.workspace / ".ralph" / "status.json").read_text())
    assert status["status"] == "finished" and not status.get("failure"), status
    assert "- [ ]" not in scenario.checklist(), scenario.checklist()
    assert not list((scenario.workspace / ".ralph").glob("crash-*")), "a crash file was written"


def test_a_closed_stdout_does_not_stop_the_loop(scenario: Scenario) -> None:
    scenario.prepare(ITEMS, agent_sleep="0.5")
    rc = scenario.root / "rc"
    line = f"{shlex.join(_command(scenario))} | head -3; echo ${{PIPESTATUS[0]}} > {rc}"
    done = subprocess.run(
        ["bash", "-c", line],
        cwd=scenario.workspace,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(done.stdout.splitlines()) == 3, done.stdout  # head read its lines, and left
    assert rc.read_text().strip() == "0", done.stderr  # the loop's exit: its checklist is done
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    _finished(scenario)


def test_sighup_does_not_stop_the_loop(scenario: Scenario) -> None:
    scenario.prepare(ITEMS, agent_sleep="1.0")
    run = RalphRun(_command(scenario), scenario.workspace)
    scenario.runs.append(run)
    run.wait_agent(1)
    run.send(signal.SIGHUP)
    assert run.wait(90) == 0, run.stderr
    _finished(scenario)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_a_terminal_that_goes_away_does_not_stop_the_loop(scenario: Scenario) -> None:
    """The pane's terminal destroyed under the run (tmux's server killed: SIGHUP, then every
    write to the terminal fails with EIO): the loop goes on to its end."""
    scenario.prepare(ITEMS, agent_sleep="1.0")
    pane = Pane(f"ralph-hup-{scenario.root.name}", _command(scenario), scenario.workspace)
    try:
        pane.wait_text("iteration 1:", timeout=60)
        loop = pane.process()
    finally:
        pane.close()
    status = scenario.workspace / ".ralph" / "status.json"
    wait_for(lambda: '"finished"' in status.read_text(), 90, "the loop to finish its checklist")
    wait_for(lambda: loop.status() == "zombie" or not loop.is_running(), 30, "the loop's exit")
    _finished(scenario)
