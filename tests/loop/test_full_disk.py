"""A full filesystem under the state, log and textfile directories (issue 11, defect 2).

`.ralph/`, `logs/` and the metrics textfile directory of a real workspace are each a 64 KiB
tmpfs, filled to the last byte at
the start of a run or between two deaths. A real loop on the stand-in server must go on: the
state that cannot be saved is a warning, a death record that cannot be written reaches stderr
whole, and no file is left torn (a record cut off half-way by ENOSPC is taken back).
Needs root (`.ci/run` is); skips with a line where mounting is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from support.e2e import AGENT_STEP, RalphRun, Scenario
from support.standin import wait_for

pytestmark = pytest.mark.timeout(120)

TMPFS_SIZE = "64k"
FULL = (".ralph", "logs", "textfile")  # state, death log and records, metrics textfile
DEATH_RECORD_LINE = "ralph-run: could not write death record ("


def _mount(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip() or done.returncode}")


def _fill(directory: Path) -> None:
    """Write until the filesystem refuses: not one byte is left."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (b"\0" * 4096, b"\0"):
            with contextlib.suppress(OSError):
                while os.write(fd, chunk):
                    pass
    finally:
        os.close(fd)


@pytest.fixture
def full(tmp_path: Path) -> Iterator[Scenario]:
    """A scenario whose workspace has each directory of FULL on a tiny tmpfs."""
    scenario = Scenario(tmp_path)
    mounted: list[Path] = []
    try:
        scenario.prepare(["first item", "second item", "third item"], agent_sleep="2")
        document = yaml.safe_load(scenario.runbook_path.read_text())
        document["metrics"] = {"textfile": "textfile/ralph.prom"}
        # two deaths during one item here are the test's kills, not the item's doing: none is
        # set aside for them (docs/deaths.md)
        document["checklist"]["set_aside_after"] = 0
        scenario.runbook_path.write_text(yaml.safe_dump(document, sort_keys=False))
        for name in FULL:
            _mount(scenario.workspace / name)
            mounted.append(scenario.workspace / name)
        yield scenario
    finally:
        scenario.close()
        for directory in mounted:
            subprocess.run(["umount", "-l", str(directory)], check=False)


def _start(scenario: Scenario) -> RalphRun:
    """Steps and warnings on stdout (--json), the unwritable records on stderr."""
    return scenario.start()


def _die_during_agent(scenario: Scenario, run: RalphRun, iteration: int) -> None:
    """The server dies while the agent of `iteration` thinks (2 s, before its call): the
    watch finds it during the step."""
    deaths = len(run.of("death"))
    began = run.wait_event("iteration", iteration=iteration, timeout=30)["time"]
    # status.json may not be written (the disk is full): the events say when the agent runs
    wait_for(
        lambda: [e for e in run.of("step", step=AGENT_STEP) if e["time"] >= began], 30, "the agent"
    )
    with contextlib.suppress(httpx.HTTPError):  # it dies answering
        scenario.standin.admin("die")
    death = run.wait_event("death", death=deaths + 1, timeout=40)
    assert death["phase"] == "during-step", death
    run.wait_event("recovery", death=deaths + 1, timeout=40)


def _records_on_stderr(stderr: str) -> list[dict]:
    """Each unwritable death record, parsed from its stderr line (whole, or this fails)."""
    records = []
    for line in stderr.splitlines():
        if line.startswith(DEATH_RECORD_LINE):
            records.append(json.loads(line[line.index("): ") + 3 :]))
    return records


def _own_lines(stderr: str) -> str:
    """stderr without the records (their server log holds the stand-in's own traceback)."""
    return "\n".join(line for line in stderr.splitlines() if "could not write" not in line)


def _metric_line(line: str) -> bool:
    """A line of the Prometheus text format: a comment, or a sample with its value."""
    if line.startswith("#"):
        return True
    name, _, value = line.rpartition(" ")
    try:
        float(value)
    except ValueError:
        return False
    return bool(name)


def _assert_nothing_torn(workspace: Path) -> None:
    for path in (workspace / "logs" / "deaths.jsonl", workspace / ".ralph" / "state.json"):
        if path.exists() and path.stat().st_size:
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".jsonl":
                assert text.endswith("\n"), text[-200:]
                for line in text.splitlines():
                    json.loads(line)
            else:
                json.loads(text)
    textfile = workspace / "textfile" / "ralph.prom"
    if textfile.exists():
        lines = textfile.read_text(encoding="utf-8").splitlines()
        assert lines and all(_metric_line(line) for line in lines), lines[-5:]
    log = workspace / "logs" / "deaths.log"
    if log.exists() and log.stat().st_size:
        text = log.read_text(encoding="utf-8")
        assert text.count("down detected") == text.count("===== END ====="), text[-500:]


def test_a_full_state_and_log_directory_at_start(full: Scenario) -> None:
    for name in FULL:
        _fill(full.workspace / name)
    run = _start(full)
    _die_during_agent(full, run, 1)

    assert run.wait(60) == 0, run.stderr
    assert "Traceback" not in _own_lines(run.stderr)
    assert full.marks() == ["x", "x", "x"], full.checklist()
    warnings = [e["message"] for e in run.of("warning")]
    assert any("pid not written: No space left on device" in w for w in warnings), warnings
    assert any("state not saved" in w and "No space left" in w for w in warnings), warnings
    assert any("metrics textfile" in w and "No space left" in w for w in warnings), warnings
    (death,) = _records_on_stderr(run.stderr)
    assert death["event"] == "death" and death["death"] == 1
    assert death["phase"] == "during-step"
    assert death["collectors"] and death["probes"], "the whole record, diagnostics and all"
    assert "could not write recovery record" in run.stderr
    _assert_nothing_torn(full.workspace)


def test_the_disk_fills_up_between_two_deaths(full: Scenario) -> None:
    run = _start(full)
    _die_during_agent(full, run, 1)  # written to disk: the log files now exist
    assert len(full.records("death")) == 1
    assert (full.workspace / "textfile" / "ralph.prom").exists(), "written while there is space"
    for name in FULL:
        _fill(full.workspace / name)
    iteration = run.of("iteration")[-1]["iteration"] + 1
    _die_during_agent(full, run, iteration)

    assert run.wait(60) == 0, run.stderr
    assert "Traceback" not in _own_lines(run.stderr)
    assert full.marks() == ["x", "x", "x"], full.checklist()
    (second,) = _records_on_stderr(run.stderr)
    assert second["death"] == 2 and second["collectors"]
    assert second["phase"] == "during-step"
    assert [r["death"] for r in full.records("death")] == [1], "death 2 lives on stderr only"
    # the console says which report was written: death 2's says it was not (issue 29, 13)
    reports = run.of("report")
    assert [r.get("written", True) for r in reports[:2]] == [True, False], reports
    assert "No space left on device" in reports[1]["error"], reports[1]
    _assert_nothing_torn(full.workspace)
    for name in FULL:  # space again: the next save and death write normally
        os.remove(full.workspace / name / "filler")
