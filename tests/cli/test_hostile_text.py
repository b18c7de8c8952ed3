"""Item texts are text (issue 29, finding 6): an item that looks like rich markup is shown as
it is by `top` (it crashed with MarkupError, exit 70) and `status`, and an item's terminal
escape sequences (a window title set, the screen cleared) reach no terminal: `top` in a tmux
pane, `status`, and the human console's iteration lines of a real loop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.e2e import RalphRun, Scenario
from support.standin import python_env, wait_for
from top_helpers import Pane

pytestmark = pytest.mark.timeout(120)

MARKUP = "fix [/bold] route [/api/v1]"
TITLE = "\x1b]2;pwn\x07"  # xterm's "set the window title"
CLEAR = "\x1b[2J"  # erase the screen
ITEM = f"{MARKUP} {TITLE}{CLEAR}[bold]now[/bold]"
SHOWN = f"{MARKUP} \\x1b]2;pwn\\x07\\x1b[2J[bold]now[/bold]"
DONE_ITEM = f"{TITLE}[bold]x[/bold]"  # the history's: short, whole in an 80-column table


def _workdir(root: Path) -> Path:
    """A workdir whose running loop (this test's pid) works on ITEM, one iteration done."""
    state = root / ".ralph"
    state.mkdir(parents=True)
    now = time.time()
    status = {
        "status": "running",
        "running": True,
        "pid": os.getpid(),
        "iteration": 2,
        "item": ITEM,
        "phase": "run the agent",
        "deaths": 0,
        "step_started": now,
        "updated": now,
        "paused": False,
        "pause": None,
        "workdir": str(root),
    }
    (state / "status.json").write_text(json.dumps(status))
    done = {"iteration": 1, "item": DONE_ITEM, "outcome": "done", "started": now - 5, "seconds": 4}
    (state / "iterations.jsonl").write_text(json.dumps(done) + "\n")
    return root


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_top_shows_markup_and_escapes_in_an_item_as_text(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path / "loop")
    top = [sys.executable, "-m", "ralph_runner", "top", str(workdir)]
    pane = Pane(f"ralph-hostile-{tmp_path.name}", top, tmp_path)
    try:
        screen = pane.wait_text(MARKUP, "\\x1b]2;pwn\\x07[bold]x[/bold]")
        assert pane.alive()  # no MarkupError: top still runs
        title = subprocess.run(
            [*pane.tmux, "display", "-p", "-t", "top", "#{pane_title}"],
            capture_output=True,
            text=True,
        ).stdout
    finally:
        pane.close()
    assert "pwn" not in title, title  # the escape set no title: it was shown, not sent
    assert "\x1b" not in screen, screen

    # the plain snapshot (stdout no terminal) too: exit 0, the item as it is, no ESC
    done = subprocess.run(
        [*top, "--once"], env=python_env(COLUMNS="200"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert SHOWN in done.stdout and "\x1b" not in done.stdout, done.stdout


def test_status_shows_an_item_as_text(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path / "loop")
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "status", str(workdir)],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"item:       {SHOWN}" in done.stdout, done.stdout
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout


def test_the_console_shows_an_items_escapes_as_text(scenario: Scenario) -> None:
    scenario.prepare([ITEM, "second"])
    command = [sys.executable, "-m", "ralph_runner", str(scenario.runbook_path)]
    run = RalphRun([*command, "-e", json.dumps(scenario.facts)], scenario.workspace)
    scenario.runs.append(run)
    wait_for(lambda: any("iteration 2:" in line for line in run.noise), 60, "two iterations")
    run.kill()
    shown = "\n".join(run.noise)
    assert f"iteration 1: {SHOWN}" in shown, shown
    assert "\x1b" not in shown and "\x07" not in shown
