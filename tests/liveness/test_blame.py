"""Blame where it belongs: a failed attempt costs the agent a strike only when the service was
the same server and working through it (issue 19).

Each test breaks the stand-in where the old rules blamed the agent: a step timeout shorter than
the hang bound, a restart by someone else between two checks, and one hang under three loops
that share the server (one restart, not three).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.e2e import AGENT_STEP, RalphRun, Scenario, make_workspace, runbook
from support.standin import ROOT, START_SCRIPT, StandIn, wait_for

from ralph_runner.liveness import recovery_lock
from ralph_runner.plugins.prometheus_text import metric_sum

pytestmark = pytest.mark.timeout(120)
ITEMS = ["add the road", "add the car"]


def running_requests(server: StandIn) -> float:
    return metric_sum(server.get("/metrics").text, "vllm:num_requests_running") or 0.0


def slow_generation(server: StandIn) -> None:
    """From now on every generation is long and slow: the agent's call stays in flight. (The
    admin endpoint applies it at once; the control file waits for the next request.)"""
    server.admin("tokens_per_second", 20)
    server.admin("busy", 100000)


def assert_no_strikes(scenario: Scenario, run: RalphRun) -> None:
    assert not run.of("strike") and not run.of("skip"), run.events
    assert scenario.marks() == ["x"] * len(ITEMS), scenario.checklist()
    assert scenario.state()["strikes"] == {}


def test_a_step_timeout_shorter_than_the_hang_bound_is_a_death_not_a_strike(scenario):
    """The engine hangs mid-generation and the step times out before any probe could call it
    stalled (no watch at all here): the checks after the step wait for the stall window to
    decide, and it is a death of the engine, no strike."""
    scenario.prepare(
        ITEMS,
        engine_probe=True,  # stall_after 3
        watch=0,
        agent_sleep="1.5 if iteration == 1 else 0.1",
        agent_timeout=120,
        step_timeout=4,
    )
    run = scenario.start()
    run.wait_agent(1)
    slow_generation(scenario.standin)
    wait_for(lambda: running_requests(scenario.standin) >= 1, 10, "the agent's call")
    scenario.standin.admin("engine_hang")

    assert run.wait() == 0, run.stderr
    timed_out = run.of("step-done", step=AGENT_STEP, timed_out=True)
    assert len(timed_out) == 1 and timed_out[0]["seconds"] < 10, json.dumps(run.events)
    (death,) = scenario.records("death")
    # Found by the first check that ran once the stall window was over: the runbook's
    # post-step check, or the one after the failure (which waits for the window to end).
    assert death["phase"] in ("post-step", "after-failure")
    assert death["fault"] == "engine stalled with work waiting", death["evidence"]
    assert "no token" in death["evidence"]
    assert [e["item"] for e in run.of("retry")] == [ITEMS[0]]
    assert_no_strikes(scenario, run)


def test_a_server_restarted_between_two_checks_is_a_death_not_a_strike(scenario):
    """Someone restarts the server during the agent's call (a kill, then a start, between two
    checks): the call dies, the next check finds a healthy server, and the new
    process_start_time_seconds says it is another one: a death, no recovery, no strike."""
    scenario.prepare(
        ITEMS,
        engine_probe=True,
        watch=0,  # no check while the step runs: only the server's identity can tell
        agent_sleep="1.5 if iteration == 1 else 0.1",
        agent_timeout=120,
    )
    run = scenario.start()
    run.wait_agent(1)
    server = scenario.standin
    slow_generation(server)
    wait_for(lambda: running_requests(server) >= 1, 10, "the agent's call")
    starts = server.starts
    assert server.pid is not None
    agents = wait_for(scenario.agent_processes, 10, "the agent")
    for agent in agents:  # it learns of the restart only once the new server is up
        agent.send_signal(signal.SIGSTOP)
    os.kill(server.pid, signal.SIGKILL)
    server.start(HEALTH_TIMEOUT="1")  # the restart by "someone else"
    for agent in agents:
        agent.send_signal(signal.SIGCONT)

    assert run.wait() == 0, run.stderr
    failed = run.of("step-done", step=AGENT_STEP, ok=False)
    assert len(failed) == 1 and not failed[0]["timed_out"]
    (death,) = scenario.records("death")
    assert death["fault"] == "restarted by someone else"
    assert "process_start_time_seconds" in death["evidence"]
    (recovery,) = scenario.records("recovery")
    assert recovery["recovered"] is True and recovery["attempts"] == 0 and recovery["steps"] == []
    assert server.starts == starts + 1  # ours only: the loop started nothing
    assert_no_strikes(scenario, run)


SLOW_START = 5  # s: the recovery's start waits this long before it starts the server


def test_three_loops_and_one_hang_recover_the_server_once(tmp_path):
    """Three repos, one server, a slow start (5 s): each loop records the death it suffered,
    one runs the recovery, the other two wait for it and say who brought it back."""
    server = StandIn(tmp_path / "vllm")
    server.start(HEALTH_TIMEOUT="1")
    try:
        _three_loops(tmp_path, server)
    finally:
        server.stop()


def _three_loops(tmp_path: Path, server: StandIn) -> None:
    facts = {
        "port": server.port,
        "standin_dir": str(server.state_dir),
        "standin_start": str(START_SCRIPT),
        "python": sys.executable,
    }
    works = [make_workspace(tmp_path / f"work{n}", ITEMS) for n in range(3)]
    runs = []
    for n, work in enumerate(works):
        book = runbook(
            engine_probe=True,
            agent_sleep="2 if iteration == 1 else 0.1",
            agent_timeout=120,
            healthy_within=20,
        )
        (start,) = book["recovery"]["steps"]
        # a slow start: overlapping ones would show
        start["shell"] = f"sleep {SLOW_START} && " + start["shell"]
        # work0 calls the hang after 3 s, the others 3 s later, while its recovery holds the
        # lock (its slow start alone lasts 5 s): the others' deaths are found during it
        probe = book["health"]["probes"][0]
        assert probe["name"] == "engine progress", probe
        probe["progress"] = {**probe["progress"], "stall_after": 3 if n == 0 else 6}
        path = tmp_path / f"runbook{n}.yaml"
        path.write_text(yaml.safe_dump(book, sort_keys=False))
        command = [sys.executable, "-m", "ralph_runner", str(path), "--json"]
        runs.append(RalphRun([*command, "-e", json.dumps(facts)], work))
    for run in runs:
        run.wait_agent(1)
    starts = server.starts
    server.trigger(engine_hang=True)

    for run in runs:
        assert run.wait(timeout=100) == 0, run.stderr
    assert server.starts == starts + 1, "one restart for three loops"
    recoveries = []
    for run, work in zip(runs, works, strict=True):
        assert not run.of("strike") and not run.of("skip"), run.events
        lines = (work / "logs" / "deaths.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["event"] for r in records] == ["death", "recovery"]
        recoveries.append(records[1])
    ran = [r for r in recoveries if r["attempts"] >= 1]
    waited = [r for r in recoveries if r["attempts"] == 0]
    assert len(ran) == 1 and len(waited) == 2, recoveries
    assert all(Path(work, "CHECKLIST.md").read_text().count("- [x]") == 2 for work in works)
    # The two that waited say who brought it back: the loop that ran the recovery, by its pid.
    ((holder, holder_run),) = [
        (work, run) for work, run, r in zip(works, runs, recoveries, strict=True) if r["attempts"]
    ]
    by = f"the loop of pid {holder_run.process.pid} in {holder}"
    assert [(r["recovered"], r["by"]) for r in waited] == [(True, by)] * 2, waited
    # work0 called the hang first and recovered; the others' deaths, found while its recovery
    # was under way, each name that loop's record, and the holder's own names none.
    assert holder == works[0], (holder, recoveries)
    for n, work in enumerate(works):
        death = json.loads((work / "logs" / "deaths.jsonl").read_text().splitlines()[0])
        if n == 0:
            assert "during_recovery" not in death, death
            continue
        during = death.get("during_recovery")
        assert during == {"by": by, "records": str(holder / "logs" / "deaths.jsonl"), "death": 1}


def test_a_recovery_under_way_is_seen_with_its_holder(tmp_path, monkeypatch):
    """recovery_lock.in_progress: who holds the service's lock, read by another process; None
    once the holder's recovery is over (or it died: the kernel drops its flock)."""
    monkeypatch.setenv("RALPH_LOCK_DIR", str(tmp_path))
    assert recovery_lock.in_progress("svc") is None  # no lock file yet
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "svc"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        seen = recovery_lock.in_progress("svc")
        assert seen is not None and seen["pid"] == holder.pid and seen["death"] == 4, seen
        assert recovery_lock.in_progress("other service") is None
    finally:
        holder.kill()
        holder.wait(10)
    assert recovery_lock.in_progress("svc") is None


HOLDER = """
import sys, threading
from ralph_runner.liveness import recovery_lock
me = {"pid": __import__("os").getpid(), "workdir": "/w", "records": "/w/d.jsonl", "death": 4}
with recovery_lock.held(sys.argv[1], me, 5.0, threading.Event()):
    print("held", flush=True)
    sys.stdin.read()
"""
