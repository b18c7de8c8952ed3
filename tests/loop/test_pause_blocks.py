"""The runbook's `pause:` and `resume:` blocks on real loops on the stand-in: the pause block
stops the server once, the resume block starts it once, and neither is a death or a strike; a
failed block is reported, the loop stays paused (pause) or goes on (resume)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import AGENT_STEP, Scenario
from support.standin import ralph, wait_for

from ralph_runner import events
from ralph_runner.output.lines import human_line

pytestmark = pytest.mark.timeout(120)

# The stand-in's whole process group, TERM, and back once it is gone (as `docker stop` returns).
STOP = (
    'pid="$(cat {{ standin_dir }}/server.pid)"; kill -TERM -- "-$pid";'
    ' while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done'
)
START = "PYTHON={{ python }} HEALTH_TIMEOUT=1 {{ standin_start }} {{ port }} {{ standin_dir }}"


def with_blocks(scenario: Scenario, pause: list[dict], resume: list[dict]) -> None:
    book: dict[str, Any] = yaml.safe_load(scenario.runbook_path.read_text())
    book["pause"], book["resume"] = pause, resume
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))


def history(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / ".ralph" / "iterations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_the_pause_block_stops_the_server_and_the_resume_block_starts_it(
    scenario: Scenario,
) -> None:
    # The agent fails the first attempt after the resume: its strike must stay the agent's, not
    # become a death because the probes first meet the new server during that attempt.
    after = "test {{ iteration }} -ne 2"
    scenario.prepare(
        ["one", "two", "three"], agent_sleep="1.0", engine_probe=True, after_agent=after
    )
    marks = scenario.root / "marks"
    with_blocks(
        scenario,
        pause=[
            {"name": "stop the stand-in", "shell": STOP, "timeout": 15},
            {"name": "mark", "shell": "echo {{ phase }} at {{ iteration }} >> {{ marks }}"},
        ],
        resume=[
            {"name": "start the stand-in", "shell": START, "timeout": 30},
            {"name": "mark", "shell": "echo {{ phase }} >> {{ marks }}"},
        ],
    )
    workdir = scenario.workspace
    run = scenario.start(marks=str(marks))
    run.wait_agent(1)
    assert ralph("pause", str(workdir)).returncode == 0

    done = run.wait_event("pause-steps", timeout=30)
    assert done["ok"] is True and done["ran"] == 2 and done["error"] is None
    assert [e["step"] for e in run.of("pause-step")] == ["stop the stand-in", "mark"]
    assert not scenario.standin.healthy() and scenario.standin.processes() == []
    status = run.wait_status(lambda s: (s.get("pause") or {}).get("steps") == "done", "done")
    assert status["paused"] is True and status["pause"]["state"] == "paused"
    assert status["pause"]["steps_error"] is None
    shown = ralph("status", str(workdir)).stdout
    assert "(pause steps done)" in shown, shown
    assert lines(marks) == ["pause at 1"]
    assert [e["item"] for e in run.of("done")] == ["one"]  # the iteration in hand was settled

    assert ralph("resume", str(workdir)).returncode == 0
    resumed = run.wait_event("resume-steps", timeout=40)
    assert resumed["ok"] is True and resumed["ran"] == 2
    assert run.wait(60) == 0, run.stderr
    assert scenario.marks() == ["x", "x", "x"]
    assert lines(marks) == ["pause at 1", "resume"]  # each block once
    assert len(run.of("pause-steps")) == 1 and len(run.of("resume-steps")) == 1
    # The server the pause block stopped was no death, and the new one no restart by
    # someone else; nothing was started by the recovery steps, no item lost a strike.
    assert run.of("death") == [] and run.of("start") == [] and run.of("recovery") == []
    assert [(e["item"], e["strikes"]) for e in run.of("strike")] == [("two", 1)]
    assert run.of("retry") == []
    # (the agent had ticked and committed "two" before the command failed: the tick is undone,
    # "two" is tried again and done, and a done item's strikes are cleared)
    assert [e["item"] for e in run.of("done")] == ["one", "two", "three"]
    assert scenario.state()["deaths"] == 0 and scenario.state()["strikes"] == {}
    outcomes = [(line["item"], line["outcome"]) for line in history(workdir)]
    assert outcomes == [("one", "done"), ("two", "strike"), ("two", "done"), ("three", "done")]
    assert scenario.standin.starts == 2  # the test's, then the resume block's
    assert scenario.records() == []
    assert run.status()["pause"] is None


def test_failed_blocks_leave_the_loop_paused_then_start_the_server_at_resume(
    scenario: Scenario,
) -> None:
    """A failed pause block: still paused, the failure in status, no death. A failed resume
    block: the loop goes on; the server the pause block stopped is not running, so the check at
    resume starts it with the recovery steps, recorded as a start, not as a death."""
    scenario.prepare(["one", "two"], agent_sleep="8 if iteration == 1 else 0.1")  # pause lands in 1
    with_blocks(
        scenario,
        pause=[
            {"name": "stop the stand-in", "shell": STOP, "timeout": 15},
            {"name": "unmount", "shell": "echo 'Error: device busy' >&2; exit 3"},
            {"name": "never reached", "shell": "true"},
        ],
        resume=[{"name": "start it", "shell": "echo no such script >&2; exit 1"}],
    )
    workdir = scenario.workspace
    run = scenario.start()
    run.wait_agent(1)
    assert ralph("pause", str(workdir)).returncode == 0

    failed = run.wait_event("pause-steps", timeout=30)
    error = "step 'unmount' failed (exit 3): Error: device busy"
    assert failed["ok"] is False and failed["error"] == error and failed["ran"] == 2
    assert [e["step"] for e in run.of("pause-step")] == ["stop the stand-in", "unmount"]
    status = run.wait_status(lambda s: (s.get("pause") or {}).get("steps") == "failed", "failed")
    assert status["paused"] is True and status["phase"] == "paused"
    assert status["pause"]["steps_error"] == error
    shown = ralph("status", str(workdir)).stdout
    assert f"(pause steps failed: {error})" in shown, shown
    assert run.of("death") == [] and run.of("strike") == []
    assert scenario.state()["deaths"] == 0

    assert ralph("resume", str(workdir)).returncode == 0
    resumed = run.wait_event("resume-steps", timeout=20)
    assert resumed["ok"] is False and "exit 1" in resumed["error"]
    started = run.wait_event("started", timeout=40)
    assert started["recovered"] is True
    assert run.wait(60) == 0, run.stderr
    assert scenario.marks() == ["x", "x"]
    assert run.of("death") == [] and run.of("strike") == [] and run.of("retry") == []
    assert scenario.state()["deaths"] == 0
    assert [r["event"] for r in scenario.records()] == ["start"]
    assert run.status()["last_start"]["recovered"] is True


def test_pause_now_runs_the_block_after_the_step_it_stopped(scenario: Scenario) -> None:
    scenario.prepare(["one", "two"], agent_sleep="30 if iteration == 1 else 0.1", step_timeout=60)
    with_blocks(
        scenario, pause=[{"name": "stop the stand-in", "shell": STOP, "timeout": 15}], resume=[]
    )
    run = scenario.start()
    run.wait_agent(1)
    wait_for(scenario.agent_processes, 10, "the agent running")
    assert ralph("pause", "--now", str(scenario.workspace)).returncode == 0

    paused = run.wait_event("paused", timeout=15)
    assert paused["killed"] == AGENT_STEP
    assert run.wait_event("pause-steps", timeout=30)["ok"] is True
    assert not scenario.agent_processes() and not scenario.standin.processes()
    assert ralph("resume", str(scenario.workspace)).returncode == 0
    # No resume block starts it: the check at resume finds nothing listening and starts it.
    assert run.wait(60) == 0, run.stderr
    assert run.of("resume-steps") == []
    assert [e["item"] for e in run.of("iteration")] == ["one", "one", "two"]
    assert run.of("strike") == [] and run.of("death") == [] and len(run.of("started")) == 1
    assert scenario.marks() == ["x", "x"]


def test_the_console_says_what_the_blocks_did() -> None:
    def plain(colour: str, text: str) -> str:
        return text

    step = human_line(events.PauseStep(step="stop vLLM"), plain)
    assert step == "  ⏸ pause step: stop vLLM"
    skipped = human_line(events.ResumeStep(step="start", skipped="when: false"), plain)
    assert skipped == "  ⏭ resume step: start: skipped (when: false)"
    ok = events.PauseSteps(ok=True, ran=1, seconds=2.04, error=None)
    assert human_line(ok, plain) == "  pause steps done in 2.0s"
    bad = {"ok": False, "ran": 1, "seconds": 0.1, "error": "step 'x' failed (exit 1)"}
    assert "still paused (no death, no strike)" in str(human_line(events.PauseSteps(**bad), plain))
    assert "started if nothing listens" in str(human_line(events.ResumeSteps(**bad), plain))
