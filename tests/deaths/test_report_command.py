"""`ralph-run report` on what a real loop leaves, and `top`'s word when a report fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.e2e import Scenario
from support.standin import python_env

pytestmark = pytest.mark.timeout(120)


def ralph_run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ralph_runner", *args],
        cwd=cwd,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_the_report_of_a_loop_with_no_death(scenario: Scenario) -> None:
    """A loop that never lost its server: iterations in its history, no death record. The
    report says so (issue 31, item 2: it crashed, exit 70, on the missing signatures chart)."""
    scenario.prepare(["add the road", "add the car"])
    run = scenario.start()
    assert run.wait() == 0, run.stderr
    history = scenario.workspace / ".ralph" / "iterations.jsonl"
    lines = [json.loads(line) for line in history.read_text(encoding="utf-8").splitlines()]
    assert [line["outcome"] for line in lines] == ["done", "done"]
    assert not (scenario.workspace / "logs" / "deaths.jsonl").exists()

    report = scenario.root / "report.html"
    done = ralph_run("report", str(scenario.workspace), "-o", str(report), cwd=scenario.root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    assert f"report: {report} (0 deaths, 2 iterations" in done.stdout
    page = report.read_text(encoding="utf-8")
    assert "no deaths recorded" in page
    assert "add the road" in page and "add the car" in page  # the timeline's iterations


def test_top_names_the_crash_file_of_a_report_that_crashed(tmp_path: Path) -> None:
    """`o` in top runs `ralph-run report` into the loop's .ralph/; when that crashes (here: its
    report.html is a folder, which it does not expect), top's message names the crash file to
    report it with (issue 31, item 2: it showed crash.py's last line, which names none)."""
    from concurrent.futures import ThreadPoolExecutor

    from ralph_runner.commands import top

    workdir = tmp_path / "work"
    (workdir / ".ralph" / top.REPORT).mkdir(parents=True)
    (workdir / ".ralph" / "iterations.jsonl").write_text("")
    with ThreadPoolExecutor(1) as pool:
        screen = top.View([top.Loop("localhost", str(workdir), None, "work")], pool, 5.0)
        said = screen._report(screen.loops[0])
    assert said.startswith("report failed, a bug in ralph-run: please report it with "), said
    crash_file = Path(said.split("please report it with ", 1)[1].split(" (", 1)[0])
    assert crash_file.is_file(), said
    assert "Traceback" in crash_file.read_text(encoding="utf-8")
    assert "IsADirectoryError" in said
    crash_file.unlink()
