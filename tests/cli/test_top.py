"""`ralph-run top` against two real loops on the stand-in: in an 80x24 tmux pane (keys p, r,
q), and as one plain snapshot when stdout is no terminal."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from e2e_helpers import RalphRun, Scenario, make_workspace
from standin_helpers import ROOT, python_env, wait_for

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]
SCREEN = ROOT / "docs" / "top-screen.txt"  # the capture docs/watching.md shows
ALPHA = ["alpha: add the parser", "alpha: test the parser", "alpha: document it"]
BETA = [f"beta: write exporter part {n}" for n in range(1, 9)]


@pytest.fixture
def two_loops(scenario: Scenario) -> Iterator[tuple[Scenario, RalphRun, RalphRun, Path]]:
    """Two loops (hosts alpha and beta of a local inventory) on one stand-in."""
    scenario.prepare(ALPHA, agent_sleep="2.5")
    beta_dir = make_workspace(scenario.root / "beta", BETA)
    alpha = scenario.start()
    command = [*alpha.process.args[:-1], alpha.process.args[-1]]
    beta = RalphRun(list(command), beta_dir)
    scenario.runs.append(beta)
    inventory = scenario.root / "inventory.yaml"
    hosts = {
        name: {"ansible_connection": "local", "ralph_workdir": str(where)}
        for name, where in (("alpha", scenario.workspace), ("beta", beta_dir))
    }
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    alpha.wait_agent(1)
    beta.wait_agent(1)
    yield scenario, alpha, beta, inventory
    for run in (alpha, beta):
        if run.process.poll() is None:
            run.send(signal.SIGTERM)
            run.wait(30)


class Pane:
    """One tmux server of its own (-L), one 80x24 window running a command."""

    def __init__(self, name: str, command: list[str], cwd: Path) -> None:
        self.tmux = ["tmux", "-L", name]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in _env().items())
        shell = f"cd {shlex.quote(str(cwd))} && env {env} {shlex.join(command)}"
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-x", "80", "-y", "24", "-s", "top", shell],
            check=True,
        )

    def text(self) -> str:
        done = subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True
        )
        return done.stdout

    def wait_text(self, *needles: str, timeout: float = 20, row: str = "") -> str:
        """The screen once it shows every needle (and a line starting with `row` that holds
        the first needle, when given)."""

        def shows() -> str | None:
            text = self.text()
            if row and not any(
                line.startswith(row) and needles[0] in line for line in text.splitlines()
            ):
                return None
            return text if all(n in text for n in needles) else None

        try:
            return wait_for(shows, timeout, f"{needles} on the screen")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the screen:\n{self.text()}") from None

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "top", *keys], check=True)

    def alive(self) -> bool:
        found = subprocess.run([*self.tmux, "has-session", "-t", "top"], capture_output=True)
        return found.returncode == 0

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


def _env() -> dict[str, str]:
    env = python_env()
    return {"PYTHONPATH": env["PYTHONPATH"], "TERM": "xterm-256color", "LANG": "C.UTF-8"}


def status(workdir: Path) -> dict:
    try:
        return json.loads((workdir / ".ralph" / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def test_top_shows_both_loops_and_pauses_the_selected_one(two_loops, tmp_path: Path) -> None:
    scenario, alpha, beta, inventory = two_loops
    command = [sys.executable, "-m", "ralph_runner", "top", "-i", str(inventory)]
    pane = Pane(f"ralph-top-{tmp_path.name}", command, scenario.root)
    try:
        pane.wait_text("alpha: add the parser", "beta: write exporter part 1", "running")
        pane.keys("p")  # the first row is selected
        alpha.wait_event("paused", timeout=30)
        wait_for(lambda: status(scenario.workspace).get("paused") is True, 10, "alpha paused")
        screen = pane.wait_text(" paused ", "pause asked for", row=">alpha")
        assert status(beta.cwd).get("paused") is False
        assert all(len(line) <= 80 for line in screen.splitlines())
        assert "\x1b" not in screen
        SCREEN.write_text(_tidy(screen, scenario.root), encoding="utf-8")

        pane.keys("r")
        alpha.wait_event("resumed", timeout=10)
        wait_for(lambda: status(scenario.workspace).get("paused") is False, 10, "alpha resumed")
        pane.keys("j", "p")  # the second row: beta
        beta.wait_event("paused", timeout=30)
        pane.keys("r")
        beta.wait_event("resumed", timeout=10)
        pane.keys("q")
        wait_for(lambda: not pane.alive(), 10, "top to quit on q")
    finally:
        pane.close()
    assert alpha.of("strike") == [] and beta.of("strike") == []

    # Not a terminal: one plain snapshot of both loops, then exit.
    snapshot = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "top", str(scenario.workspace), str(beta.cwd)],
        env=python_env(COLUMNS="80"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert snapshot.returncode == 0, snapshot.stderr
    assert "\x1b" not in snapshot.stdout
    for name in ("work", "beta", "item (attempt)", "d/t/s"):
        assert name in snapshot.stdout, snapshot.stdout
    assert all(len(line) <= 80 for line in snapshot.stdout.splitlines())


def _tidy(screen: str, root: Path) -> str:
    """The capture as the docs show it: the test's temporary directories as /srv/ralph/HOST."""
    lines = [line.rstrip().replace(str(root), "/srv/ralph") for line in screen.splitlines()]
    lines = [re.sub(r"\(([\w-]+):/tmp/\S*", r"(\1:/srv/ralph/\1)", line) for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"
