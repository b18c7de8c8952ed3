"""`ralph-run pause` / `resume` on real loops on the stand-in: held at the iteration boundary,
with no strike and no lost item; `--now` stops the running step as SIGTERM would."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import yaml
from support.e2e import AGENT_STEP, Scenario
from support.standin import ralph, wait_for

from ralph_runner.loop import pause

pytestmark = pytest.mark.timeout(120)


def history(workdir: Path) -> list[dict]:
    path = workdir / ".ralph" / "iterations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def with_metrics(scenario: Scenario) -> Path:
    """The scenario's runbook, writing a Prometheus textfile; its path."""
    textfile = scenario.root / "metrics" / "ralph.prom"
    textfile.parent.mkdir()
    book = yaml.safe_load(scenario.runbook_path.read_text())
    book["metrics"] = {"textfile": str(textfile)}
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    return textfile


def test_pause_waits_after_the_iteration_and_resume_goes_on(scenario: Scenario) -> None:
    scenario.prepare(["one", "two", "three"], agent_sleep="1.0")
    textfile = with_metrics(scenario)
    inventory = scenario.root / "inventory.yaml"
    workdir = scenario.workspace
    hosts = {"here": {"ansible_connection": "local", "ralph_workdir": str(workdir)}}
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    run = scenario.start()
    run.wait_agent(1)

    asked = ralph("pause", str(workdir))
    assert asked.returncode == 0, asked.stderr
    assert "pause asked for" in asked.stdout
    paused = run.wait_event("paused", timeout=30)
    assert paused["killed"] is None and paused["now"] is False
    status = run.wait_status(lambda s: s.get("paused") is True, "paused in status.json")
    assert status["phase"] == "paused" and status["pause"]["state"] == "paused"
    assert status["running"] is True
    # The iteration in hand finished and was settled; the next one has not started.
    assert [e["item"] for e in run.of("done")] == ["one"]
    assert len(run.of("iteration")) == 1
    wait_for(lambda: 'ralph_paused{host="localhost"} 1.0' in textfile.read_text(), 5, "gauge")
    time.sleep(3 * pause.POLL)  # an absence cannot be polled: three looks at the file
    assert len(run.of("iteration")) == 1 and run.of("resumed") == []
    shown = ralph("status", str(workdir))
    assert "paused" in shown.stdout, shown.stdout
    again = ralph("pause", str(workdir))  # issue 31, item 6: not "pause asked for" again
    assert again.returncode == 0 and f"{workdir}: already paused: the loop waits" in again.stdout

    resumed = ralph("resume", "-i", str(inventory))  # over the host's (local) connection
    assert resumed.returncode == 0, resumed.stderr
    assert "here:" in resumed.stdout and "resumed" in resumed.stdout
    assert run.wait_event("resumed")["seconds"] > 0
    assert run.wait(60) == 0, run.stderr
    assert scenario.marks() == ["x", "x", "x"]
    assert run.of("strike") == [] and run.of("retry") == []
    assert [line["outcome"] for line in history(workdir)] == ["done", "done", "done"]
    assert 'ralph_paused{host="localhost"} 0.0' in textfile.read_text()
    assert not pause.control_path(workdir).exists()
    assert ralph("resume", str(workdir)).stdout.strip().endswith("no pause was asked for")


def test_pause_now_stops_the_step_with_no_strike(scenario: Scenario) -> None:
    scenario.prepare(["one", "two"], agent_sleep="30 if iteration == 1 else 0.1", step_timeout=60)
    run = scenario.start()
    run.wait_agent(1)
    wait_for(scenario.agent_processes, 10, "the agent running")

    asked = ralph("pause", "--now", str(scenario.workspace))
    assert asked.returncode == 0, asked.stderr
    paused = run.wait_event("paused", timeout=15)
    assert paused["killed"] == AGENT_STEP and paused["item"] == "one"
    wait_for(lambda: not scenario.agent_processes(), 10, "the agent's tree killed")
    status = run.wait_status(lambda s: s.get("paused") is True, "paused in status.json")
    assert status["pause"]["now"] is True and status["pause"]["killed_step"] == AGENT_STEP
    assert status["item"] == "one"
    assert scenario.state()["strikes"] == {}
    assert run.of("strike") == [] and run.of("step-done", step=AGENT_STEP) == []
    assert history(scenario.workspace)[-1]["outcome"] == "paused"
    assert scenario.marks() == [" ", " "]

    assert ralph("resume", str(scenario.workspace)).returncode == 0
    assert run.wait(60) == 0, run.stderr
    assert scenario.marks() == ["x", "x"]
    assert run.of("strike") == [] and run.of("retry") == []
    assert [e["item"] for e in run.of("iteration")] == ["one", "one", "two"]
    assert [line["outcome"] for line in history(scenario.workspace)] == ["paused", "done", "done"]


def test_a_pause_left_behind_holds_the_next_run_and_sigterm_ends_the_wait(
    scenario: Scenario,
) -> None:
    scenario.prepare(["one"])
    pause.request(scenario.workspace)
    run = scenario.start()
    paused = run.wait_event("paused")
    assert paused["iteration"] == 0 and run.of("iteration") == []
    started = time.monotonic()
    run.send(signal.SIGTERM)
    assert run.wait(20) == 143
    assert time.monotonic() - started < 10
    assert scenario.marks() == [" "]
    status = run.status()
    assert status["status"] == "interrupted" and status["paused"] is False
