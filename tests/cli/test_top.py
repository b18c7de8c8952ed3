"""`ralph-run top` as a person uses it, in an 80x24 tmux pane: two real loops on two stand-ins,
one of them dying and recovering on screen (the capture docs/watching.md shows), keys p, r, o
and q; one plain snapshot when stdout is no terminal; and ten busy loops' screen at its 1 s
refresh for under 5% of a core."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.e2e import RalphRun, Scenario
from support.standin import ROOT, cmdline_of, python_env, wait_for
from top_helpers import (
    Pane,
    Rewriter,
    iteration_of,
    number_of,
    recorded_workdir,
    state_of,
    watched_runbook,
)

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]
SCREEN = ROOT / "docs" / "top-screen.txt"  # the capture, also copied into docs/watching.md
WATCHING = ROOT / "docs" / "watching.md"
ALPHA = ["alpha: add the parser", "alpha: test the parser", "alpha: document it"]
ALPHA += [f"alpha: parse case {n}" for n in range(1, 9)]
BETA = [f"beta: write exporter part {n}" for n in range(1, 16)]
TOP = [sys.executable, "-m", "ralph_runner", "top"]
RECOVERY_DELAY = 4.0  # s the recovery's start step waits first: the screen sees it


@pytest.fixture
def two_loops(tmp_path: Path) -> Iterator[tuple[Scenario, Scenario, RalphRun, RalphRun, Path]]:
    """Two loops (hosts alpha and beta of a local inventory), each on a stand-in of its own,
    with the flight recorder and the agent proxy; alpha's recovery takes RECOVERY_DELAY s more."""
    alpha_scenario, beta_scenario = Scenario(tmp_path), Scenario(tmp_path / "beta")
    try:
        alpha_scenario.prepare(ALPHA, agent_sleep="2.5")
        beta_scenario.prepare(BETA, agent_sleep="2.5")
        watched_runbook(alpha_scenario.runbook_path, recovery_delay=RECOVERY_DELAY)
        watched_runbook(beta_scenario.runbook_path)
        alpha, beta = alpha_scenario.start(), beta_scenario.start()
        hosts = {
            name: {"ansible_connection": "local", "ralph_workdir": str(where.workspace)}
            for name, where in (("alpha", alpha_scenario), ("beta", beta_scenario))
        }
        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
        alpha.wait_agent(1)
        beta.wait_agent(1)
        yield alpha_scenario, beta_scenario, alpha, beta, inventory
        for run in (alpha, beta):
            if run.process.poll() is None:
                run.send(signal.SIGTERM)
                run.wait(30)
    finally:
        alpha_scenario.close()
        beta_scenario.close()


def status(workdir: Path) -> dict:
    try:
        return json.loads((workdir / ".ralph" / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def test_top_shows_a_death_and_its_recovery_and_pauses_the_selected_loop(
    two_loops, tmp_path: Path
) -> None:
    scenario, other, alpha, beta, inventory = two_loops
    alpha.wait_agent(2)  # one iteration done: its receipt is in the history
    pane = Pane(f"ralph-top-{tmp_path.name}", [*TOP, "-i", str(inventory)], scenario.root)
    try:
        screen = pane.wait_screen(
            lambda s: state_of(s, "alpha") == "running" == state_of(s, "beta") and s, 20, "rows"
        )
        assert number_of(screen, "alpha", "deaths") == 0
        assert "tokens p/g" in screen and "tok/s" in screen

        # A death as it happens: the deaths column counts up, the state says recovering.
        scenario.standin.trigger(die=True)
        screen = pane.wait_screen(
            lambda s: re.fullmatch(r"recovering [2-9]s", state_of(s, "alpha") or "") and s,
            20,
            "alpha recovering for 2 s",
        )
        assert number_of(screen, "alpha", "deaths") == 1
        assert state_of(screen, "beta") == "running"
        assert number_of(screen, "beta", "deaths") == 0
        assert "alpha: death 1 at" in screen and "server log (recorder):" in screen
        lines = screen.rstrip("\n").splitlines()
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        assert lines[-1].startswith("up/down j/k select"), screen  # all of it fits
        assert "\x1b" not in screen
        assert alpha.of("recovery") == []  # it was caught while the recovery ran
        _show_in_docs(_tidy(screen, scenario.root))

        alpha.wait_event("recovery", timeout=40, recovered=True)
        pane.wait_screen(
            lambda s: state_of(s, "alpha") == "running" and number_of(s, "alpha", "deaths") == 1,
            20,
            "alpha running again after its death",
        )
        alpha.wait_event("retry", timeout=5)

        # p pauses the selected loop (the first row) after the iteration in hand; r resumes.
        pane.keys("p")
        alpha.wait_event("paused", timeout=30)
        pane.wait_text(" paused ", "pause asked for", row=">alpha")
        assert status(other.workspace).get("paused") is False
        pane.keys("r")
        alpha.wait_event("resumed", timeout=10)

        # o writes the selected loop's report, into its .ralph/, and says where.
        report = scenario.workspace / ".ralph" / "report.html"
        pane.keys("o")
        pane.wait_text("alpha: report: work/.ralph/report.html (1 death,", timeout=90)
        assert "death" in report.read_text(encoding="utf-8")

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
        [*TOP, str(scenario.workspace), str(other.workspace)],
        env=python_env(COLUMNS="80"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert snapshot.returncode == 0, snapshot.stderr
    assert "\x1b" not in snapshot.stdout
    for name in ("work", "item (attempt)", "d/t/s", "tokens p/g", "tok/s"):
        assert name in snapshot.stdout, snapshot.stdout
    assert all(len(line) <= 80 for line in snapshot.stdout.splitlines())


def _tidy(screen: str, root: Path) -> str:
    """The capture as the docs show it: the test's temporary directories as /srv/ralph/HOST."""
    lines = [line.rstrip().replace(str(root), "/srv/ralph") for line in screen.splitlines()]
    lines = [re.sub(r"\(([\w-]+):/tmp/\S*", r"(\1:/srv/ralph/\1)", line) for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with recorded_workdir(tmp_path_factory.mktemp("recorded")) as workdir:
        yield workdir


def test_top_of_ten_busy_loops_costs_under_5_percent_of_a_core(
    recorded: Path, tmp_path: Path
) -> None:
    workdirs = [tmp_path / f"loop-{n}" for n in range(10)]
    writer = Rewriter(recorded, workdirs, period=0.5)  # a new iteration every 0.5 s, each
    writer.start()
    pane = Pane(f"ralph-top-{tmp_path.name}", [*TOP, *map(str, workdirs)], tmp_path)
    try:
        pane.wait_screen(
            lambda s: all(state_of(s, w.name) == "running" for w in workdirs) and "tok/s" in s,
            30,
            "ten running loops",
        )
        top = pane.process()
        assert "top" in cmdline_of(top)

        def spent() -> float:
            times = top.cpu_times()
            return times.user + times.system + times.children_user + times.children_system

        before, started = spent(), time.monotonic()
        first = iteration_of(pane.text(), "loop-9") or 0
        clocks: set[str] = set()
        pause = threading.Event()
        while time.monotonic() - started < 10:
            clocks.add(pane.text().splitlines()[0])  # the header's clock: it redrew
            pause.wait(0.25)  # the sampling interval of the measurement
        used, wall = spent() - before, time.monotonic() - started
        screen = pane.text()
    finally:
        pane.close()
        writer.close()
    assert len(clocks) >= 8, clocks  # a redraw every second, all along
    assert (iteration_of(screen, "loop-9") or 0) >= first + 10, screen  # and it kept reading
    assert used < 0.05 * wall, f"top used {used:.2f} s of CPU in {wall:.1f} s"


def _show_in_docs(capture: str) -> None:
    """With RALPH_REFRESH_DOCS=1, the capture into docs/top-screen.txt and into
    docs/watching.md's block that follows the line naming that file (tests/docs checks that the
    two agree). Without it the docs are left alone: a test run leaves the checkout clean."""
    if os.environ.get("RALPH_REFRESH_DOCS") != "1":
        return
    SCREEN.write_text(capture, encoding="utf-8")
    text = WATCHING.read_text(encoding="utf-8")
    marker = text.index("`docs/top-screen.txt`")
    start = text.index("```text\n", marker) + len("```text\n")
    end = text.index("```", start)
    WATCHING.write_text(text[:start] + capture + text[end:], encoding="utf-8")
