"""ralph-run end to end: the CLI as a subprocess, the stand-in server broken on cue, real git.

Every test checks what an operator would look at afterwards: the exit code, CHECKLIST.md, the
death log and its JSON twin, .ralph/state.json, and that no server or agent process is left.
Faults are set through the stand-in's control file at moments read from ralph-run's own
events and status file; no sleep is used to wait for anything.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.e2e import (
    AGENT_STEP,
    DEATH_LINE,
    ITEM_SECTION,
    SERVER_LOG_SECTION,
    Scenario,
    collector_output,
    processes_in,
    recovery_lines,
    report_blocks,
)
from support.standin import ROOT, StandIn, process_gone, python_env, wait_for

pytestmark = pytest.mark.timeout(120)  # a loaded 2-core CI machine: recoveries take longer

ITEMS = ["add the road", "add the car", "add the controls"]
STARTUP_LINE = "Application startup complete."


def assert_no_strikes(scenario: Scenario, *runs) -> None:
    """Nothing falsely skipped: no strike, no skip, no `- [!]`, no strike kept in the state."""
    for run in runs:
        assert not run.of("strike") and not run.of("skip"), run.events
    assert "!" not in scenario.marks(), scenario.checklist()
    assert scenario.state()["strikes"] == {}


def assert_died_of_its_own_log(section: str) -> None:
    """The captured server log ends with the death of the server that was running then: its
    death line comes from the process that wrote the last line (a tail of a long life may not
    reach back to its startup line; when it does, the death comes after it)."""
    assert DEATH_LINE in section
    pids = re.findall(r"^\s*\((?:APIServer|EngineCore) pid=(\d+)\)", section, re.MULTILINE)
    (death,) = [line.strip() for line in section.splitlines() if DEATH_LINE in line][-1:]
    assert death.startswith(f"(EngineCore pid={pids[-1]})"), section
    if STARTUP_LINE in section:
        assert section.rindex(DEATH_LINE) > section.rindex(STARTUP_LINE), section


def test_two_deaths_are_recovered_and_every_item_is_done(scenario: Scenario) -> None:
    items = [f"item {n}: one small change" for n in range(1, 7)]
    # the engine probe: the KV-cache death leaves the API server answering for a moment
    scenario.prepare(items, agent_sleep="0.3", engine_probe=True)
    run = scenario.start()

    run.wait_agent(2)
    scenario.standin.trigger(die=True)  # on the next request: a probe or the agent's call
    run.wait_event("recovery", death=1)
    run.wait_status(lambda s: s["done"] >= 3, "three items done after the first recovery")
    scenario.standin.trigger(die_on_prompt_chars=10)  # the KV-cache assertion on the next prompt

    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x"] * len(items)
    deaths, recoveries = scenario.records("death"), scenario.records("recovery")
    assert [d["death"] for d in deaths] == [1, 2]
    assert [(r["death"], r["recovered"], r["attempts"]) for r in recoveries] == [
        (1, True, 1),
        (2, True, 1),
    ]
    for death in deaths:
        assert_died_of_its_own_log(collector_output(death, SERVER_LOG_SECTION))
        assert death["item"]["text"] in items
        # Each death comes with an agent's call (death 1: the next request once the agent runs,
        # the stand-in reads its faults at every request; death 2: the agent's prompt, the
        # canary's "ping" is under 10 characters), so it is found in that iteration: by the
        # watcher during the step, by the post-step check, or after the failed step (the API
        # server answers for --shutdown-delay after its engine died); never at the next start.
        assert death["phase"] in ("during-step", "post-step", "after-failure"), death["phase"]
        if death["phase"] != "post-step":  # the step it killed, or the step that failed
            assert death["step"]["name"] == AGENT_STEP, (death["phase"], death.get("step"))
        failing = [p["reason"] for p in death["probes"] if not p["ok"]]
        assert failing and set(failing) <= {"refused", "status"}, death["probes"]
    log = scenario.death_log()
    blocks = report_blocks(log)
    assert len(blocks) == 2 and log.count("down detected") == 2
    for number, block in enumerate(blocks, start=1):
        assert f"death #{number}" in block[""]
        assert_died_of_its_own_log(block[SERVER_LOG_SECTION])
    assert [line.startswith("--- recovery: recovered") for line in recovery_lines(log)] == [
        True,
        True,
    ]
    assert [e["item"] for e in run.of("retry")] == [d["item"]["text"] for d in deaths]
    (summary,) = run.of("summary")
    assert (summary["done"], summary["todo"], summary["deaths"]) == (len(items), 0, 2)
    assert_no_strikes(scenario, run)
    state = scenario.state()
    assert (state["status"], state["deaths"]) == ("finished", 2)
    assert scenario.standin.starts == 3
    scenario.assert_nothing_left()


def test_recovery_impossible_gives_up_with_exit_4_and_skips_nothing(scenario: Scenario) -> None:
    scenario.prepare(ITEMS, agent_sleep="0.3", attempts=2, delay=0.2)
    run = scenario.start()

    run.wait_agent(1)
    (scenario.standin.state_dir / "fail_starts").write_text("100\n")  # the GPU stays taken
    scenario.standin.trigger(die=True)

    assert run.wait() == 4, run.stderr
    assert "service not recovered" in run.stderr
    (death,) = scenario.records("death")
    (recovery,) = scenario.records("recovery")
    assert death["item"]["text"] in ITEMS
    assert (recovery["death"], recovery["recovered"], recovery["attempts"]) == (1, False, 2)
    assert "start the stand-in" in recovery["reason"] and "attempt 2 of 2" in recovery["reason"]
    assert [s["ok"] for s in recovery["steps"]] == [False, False]
    assert "CUDA out of memory" in recovery["steps"][-1]["output"]
    log = scenario.death_log()
    assert len(report_blocks(log)) == 1
    (outcome,) = recovery_lines(log)
    assert outcome.startswith("--- recovery FAILED") and "attempt 2 of 2" in outcome
    (event,) = run.of("recovery")
    assert event["recovered"] is False
    assert_no_strikes(scenario, run)
    assert scenario.marks()[-1] == " "
    state = scenario.state()
    assert (state["status"], state["deaths"]) == ("gave-up", 1)
    assert scenario.standin.starts == 1
    scenario.assert_nothing_left()


def test_a_failed_start_is_retried_and_the_second_attempt_recovers(scenario: Scenario) -> None:
    scenario.prepare(ITEMS, agent_sleep="0.3", attempts=2, delay=0.2)
    run = scenario.start()

    run.wait_agent(1)
    (scenario.standin.state_dir / "fail_starts").write_text("1\n")
    scenario.standin.trigger(die=True)

    assert run.wait() == 0, run.stderr
    (recovery,) = scenario.records("recovery")
    assert (recovery["recovered"], recovery["attempts"]) == (True, 2)
    assert [(s["attempt"], s["ok"]) for s in recovery["steps"]] == [(1, False), (2, True)]
    (event,) = run.of("recovery")
    assert (event["recovered"], event["attempts"]) == (True, 2)
    assert [e["attempt"] for e in run.of("recovery-step")] == [1, 2]
    (failed,) = run.of("recovery-failed")  # the console says why and how long it waits
    assert (failed["attempt"], failed["retry_in"]) == (1, 0.2)
    assert failed["reason"] == (  # its last line: no error-shaped line to explain it
        "step 'start the stand-in' failed (exit 1): "
        "[start] CUDA out of memory: another job holds 80 GiB"
    )
    assert scenario.marks() == ["x"] * len(ITEMS)
    assert_no_strikes(scenario, run)
    assert scenario.standin.starts == 2
    scenario.assert_nothing_left()


def test_an_engine_death_behind_a_models_probe_still_costs_no_strike(scenario: Scenario) -> None:
    """vLLM's /v1/models answers 200 for a moment after its engine died: the agent fails at
    once, post-step sees "healthy", and only the after-failure look sees the server gone.
    (0.6 s here, twice what vLLM measured, so that a look one `interval` later is too soon.)"""
    scenario.prepare(ITEMS, agent_sleep="0.3")
    scenario.standin.stop()
    scenario.standin.start(HEALTH_TIMEOUT="1", SHUTDOWN_DELAY="0.6")
    run = scenario.start()

    run.wait_agent(2)
    scenario.standin.admin("die_on_prompt_chars", 1)  # the agent's call kills the engine

    assert run.wait() == 0, run.stderr
    (death,) = scenario.records("death")
    assert death["phase"] == "after-failure"
    assert scenario.marks() == ["x"] * len(ITEMS)
    assert_no_strikes(scenario, run)
    scenario.assert_nothing_left()


def test_an_engine_dead_503_with_the_process_alive_is_a_death(scenario: Scenario) -> None:
    scenario.prepare(ITEMS, agent_sleep="0.3")
    run = scenario.start()

    run.wait_agent(1)
    old_pid = scenario.standin.pid
    scenario.standin.trigger(dead_503=True)  # the process lives on and holds its port

    assert run.wait() == 0, run.stderr
    (death,) = scenario.records("death")
    assert [(p["reason"], p["detail"].startswith("HTTP 503")) for p in death["probes"]] == [
        ("status", True)
    ]
    (recovery,) = scenario.records("recovery")
    assert recovery["recovered"] is True
    assert process_gone(old_pid) and scenario.standin.pid != old_pid  # the start script replaced it
    assert scenario.marks() == ["x"] * len(ITEMS)
    assert_no_strikes(scenario, run)
    scenario.assert_nothing_left()


def test_a_hang_during_the_agent_step_is_caught_by_the_watch(scenario: Scenario) -> None:
    step_timeout = 30
    scenario.prepare(
        ITEMS,
        agent_sleep="1.5 if iteration == 2 else 0.1",  # time to find it before it calls
        agent_timeout=120,  # only the watch can end the hung call in time
        after_agent="echo agent finished",  # bash stays the agent's parent: a process tree
        step_timeout=step_timeout,
    )
    run = scenario.start()

    assert run.wait_agent(2)["iteration"] == 2
    agents = scenario.wait_agent_tree()
    hung = time.time()
    scenario.standin.trigger(hang=True)

    killed = run.wait_event("step-done", step=AGENT_STEP, killed=True)
    # Worst case after the hang: watch + 2 x probe timeout + interval = 2.4 s, then the kill.
    assert killed["time"] - hung < 5
    assert killed["seconds"] < 10 < step_timeout
    for agent in agents:
        wait_for(lambda pid=agent.pid: process_gone(pid), 3, f"agent process {agent.pid} gone")
    death = run.wait_event("death")
    assert death["phase"] == "during-step"
    assert death["reason"].startswith("models endpoint: timeout")

    assert run.wait() == 0, run.stderr
    (record,) = scenario.records("death")
    hung_item = record["item"]["text"]
    assert (record["phase"], record["iteration"], hung_item) == ("during-step", 2, ITEMS[1])
    assert [e["item"] for e in run.of("retry")] == [hung_item]
    assert [e["item"] for e in run.of("iteration")] == [ITEMS[0], ITEMS[1], ITEMS[1], ITEMS[2]]
    (recovery,) = scenario.records("recovery")
    assert recovery["recovered"] is True
    assert scenario.marks() == ["x"] * len(ITEMS)
    assert_no_strikes(scenario, run)
    scenario.assert_nothing_left()


def test_a_single_slow_probe_is_not_a_death(scenario: Scenario) -> None:
    scenario.prepare(
        ITEMS[:2],
        probe_timeout=1,
        failures_before_dead=2,
        # After its call, the agent's step lingers: only probes reach the server then.
        after_agent="sleep {{ 2 if iteration == 1 else 0 }}",
    )
    server = scenario.standin.pid
    run = scenario.start()

    wait_for(lambda: scenario.marks()[0] == "x", what="the agent to tick the first item")
    assert run.status()["phase"] == AGENT_STEP
    scenario.standin.trigger(slow_once=1.5)  # one probe times out; the next answers
    control = scenario.standin.state_dir / "control.json"
    wait_for(lambda: not control.exists(), 5, "the server to take the fault")

    assert run.wait() == 0, run.stderr
    assert not run.of("death") and not run.of("recovery-step")
    assert scenario.records() == []
    assert scenario.standin.starts == 1 and scenario.standin.pid == server
    assert scenario.marks() == ["x", "x"]
    (summary,) = run.of("summary")
    assert summary["deaths"] == 0
    assert scenario.state()["deaths"] == 0
    scenario.assert_nothing_left()


def test_items_that_look_like_shell_are_never_run(scenario: Scenario) -> None:
    items = ["$(touch PWNED)", "`touch PWNED2`", "'; touch PWNED3; '"]
    scenario.prepare(items, agent_sleep="0.3")
    run = scenario.start()

    run.wait_agent(1)
    scenario.standin.trigger(die=True)  # the death report's collectors get the item too

    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x"] * len(items)
    assert [line[6:] for line in scenario.checklist().splitlines()] == items
    assert list(scenario.root.rglob("PWNED*")) == []
    assert list(ROOT.glob("PWNED*")) == []
    (death,) = scenario.records("death")
    assert death["item"]["text"] in items
    assert collector_output(death, ITEM_SECTION) == death["item"]["text"] + "\n"
    subjects = subprocess.run(
        ["git", "log", "--format=%s"],
        cwd=scenario.workspace,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert sorted(subjects[:3]) == sorted(f"done: {item}" for item in items)
    assert_no_strikes(scenario, run)
    scenario.assert_nothing_left()


def test_sigterm_mid_step_stops_cleanly_and_the_run_resumes(scenario: Scenario) -> None:
    scenario.prepare(
        ITEMS,
        agent_sleep="3 if iteration >= slow_from else 0.3",
        after_agent="echo agent finished",
        variables={"slow_from": 1000},
    )
    run = scenario.start(slow_from=3)
    run.wait_agent(1)
    scenario.standin.trigger(die=True)
    run.wait_event("recovery", death=1, recovered=True)
    run.wait_agent(3)
    agents = scenario.wait_agent_tree()

    sent = time.monotonic()
    run.send(signal.SIGTERM)
    code = run.wait(20)
    assert code == 143, run.stderr
    assert time.monotonic() - sent < 5
    assert all(process_gone(agent.pid) for agent in agents)
    assert scenario.agent_processes() == []
    (interrupted,) = run.of("interrupted")
    assert interrupted["exit_code"] == 143
    state = scenario.state()
    assert (state["status"], state["deaths"], state["strikes"]) == ("interrupted", 1, {})
    assert state["current_item"] in ITEMS
    assert " " in scenario.marks()

    again = scenario.start()
    assert again.wait() == 0, again.stderr
    (resume,) = again.of("resume")
    assert (resume["deaths"], resume["item"]) == (1, state["current_item"])
    assert again.of("iteration")[0]["iteration"] == state["iteration"] + 1
    (summary,) = again.of("summary")
    assert (summary["deaths"], summary["todo"]) == (1, 0)
    assert scenario.marks() == ["x"] * len(ITEMS)
    assert len(scenario.records("death")) == 1
    assert (scenario.state()["status"], scenario.state()["deaths"]) == ("finished", 1)
    assert_no_strikes(scenario, run, again)
    scenario.assert_nothing_left()


@pytest.mark.timeout(90)
def test_the_readme_demo_recovers_two_deaths(tmp_path: Path) -> None:
    workspace = tmp_path / "demo"
    try:
        result = subprocess.run(
            [sys.executable, "-m", "ralph_runner", "demo", "--dir", str(workspace)],
            cwd=tmp_path,
            env=python_env(),
            capture_output=True,
            text=True,
            timeout=80,
        )
    finally:
        servers = StandIn(workspace / ".standin")  # only to find and stop the demo's servers
        left = servers.processes()
        servers.stop()

    assert result.returncode == 0, result.stdout + result.stderr
    # It says first what will happen and where; it ends with the summary still on screen (not
    # under a whole death record) and what to try next (issue 31, item 9).
    first = result.stdout.split("\n\n", 1)[0]
    assert first.startswith("ralph-run demo: ") and str(workspace) in first, first
    assert "broken on purpose, twice" in first, first
    last = result.stdout.rstrip("\n").splitlines()[-15:]
    assert any(line.startswith("total: 2 deaths, 2 recovered") for line in last), last
    assert f"  ralph-run deaths {workspace}" in "\n".join(last), last
    assert "===== END =====" not in result.stdout
    log = workspace / "logs" / "vllm-deaths.log"
    assert f"death log: {log}" in result.stdout
    rows = re.findall(r"^#\d+ .* recovered in [\d.]+ s", result.stdout, re.MULTILINE)
    assert len(rows) == 2, result.stdout
    assert "total: 2 deaths, 2 recovered" in result.stdout
    assert "0 not recovered" in result.stdout
    assert log.read_text(encoding="utf-8").count("down detected") == 2
    assert left == []
    assert processes_in(workspace) == []
    # The demo runs its agent through the loop's proxy (loop.proxy): every iteration has its
    # receipt, and each item done was counted: its request, its prompt's tokens (issue 31, 22).
    history = workspace / ".ralph" / "iterations.jsonl"
    lines = [json.loads(line) for line in history.read_text(encoding="utf-8").splitlines()]
    assert lines and all(line["receipt"] is not None for line in lines), lines
    done = [line for line in lines if line["outcome"] == "done"]
    assert len(done) == 8, lines
    for line in done:
        assert line["receipt"]["requests"] >= 1 and line["receipt"]["prompt_tokens"] > 0, line
    report = (workspace / "report.html").read_text(encoding="utf-8")
    assert "no receipts in the history" not in report
