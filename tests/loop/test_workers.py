"""`loop.workers: N`: items at once in git worktrees, against the stand-in server (real git,
real processes): landings, conflicts retried, order, one death for all, stops and reruns.

The workspace and the agent: tests/support/workers.py.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time

import pytest
import yaml
from support.e2e import Scenario
from support.standin import ralph, wait_for
from support.workers import all_in_flight, assert_clean, git, in_flight_at_most, prepare, strikes

from ralph_runner.loop.pause import POLL
from ralph_runner.plugins.prometheus_text import metric_sum

HELD_S = 4 * POLL  # s a pause is watched: four of the scheduler's looks at its control file

pytestmark = pytest.mark.timeout(120)


def test_eight_items_four_workers_all_land_overlapping(scenario: Scenario) -> None:
    items = [f"ok {n}" for n in range(1, 9)]
    prepare(scenario, items, sleep="0.5")
    run = scenario.start()
    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x"] * 8
    assert len(run.of("worker-landed")) == 8
    assert in_flight_at_most(run) >= 3, run.events
    assert not strikes(run)
    for n in range(1, 9):
        assert (scenario.workspace / f"ok_{n}.txt").read_text() == f"ok {n}\n"
    log = git(scenario.workspace, "log", "--format=%s")
    assert log.count("ralph-run: done: ") == 8
    # the history: a line per attempt, each done, and their spans overlap
    lines = [json.loads(line) for line in (scenario.workspace / ".ralph" / "iterations.jsonl")
             .read_text().splitlines()]  # fmt: skip
    assert sorted(line["outcome"] for line in lines) == ["done"] * 8
    spans = sorted((line["started"], line["started"] + line["seconds"]) for line in lines)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans
    assert_clean(scenario)


def test_two_items_on_the_same_lines_both_land_one_retried(scenario: Scenario) -> None:
    prepare(scenario, ["same a", "same b"], workers=2, sleep="0.5")
    run = scenario.start()
    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x", "x"]
    conflicts = run.of("worker-conflict")
    assert len(conflicts) == 1, run.events
    assert not strikes(run)
    landed = [e["item"] for e in run.of("worker-landed")]
    assert sorted(landed) == ["same a", "same b"]
    assert (scenario.workspace / "shared.txt").read_text() == f"{landed[-1]}\n"
    assert_clean(scenario)


def test_an_item_that_needs_the_one_before_lands_after_it(
    scenario: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the first item is done only once the second, started beside it, has failed and been put
    # back to wait (its event, not a sleep, opens the gate)
    gate = scenario.root / "slow-gate"
    monkeypatch.setenv("SLOW_GATE", str(gate))  # the run's, its agent's environment
    prepare(scenario, ["slow one", "needs slow one"], workers=2)
    run = scenario.start()
    run.wait_event("worker-retry", timeout=60, item="needs slow one")
    gate.touch()
    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x", "x"]
    assert not strikes(run)
    retried = run.of("worker-retry", item="needs slow one")
    assert retried and retried[0]["waits"] is True
    landed = [e["item"] for e in run.of("worker-landed")]
    assert landed == ["slow one", "needs slow one"]
    assert_clean(scenario)


def test_a_death_with_four_in_flight_is_one_death_one_restart(scenario: Scenario) -> None:
    # the four first attempts last until the death kills them (it kills every step in flight):
    # the kill below has no window to land in
    prepare(scenario, [f"ok {n}" for n in range(1, 7)], sleep="60 if iteration <= 4 else 0.2")
    run = scenario.start()
    all_in_flight(run, 4)
    starts = scenario.standin.starts
    pid = scenario.standin.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # the server dies under all four
    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x"] * 6
    assert len(run.of("death")) == 1, run.events
    assert len(scenario.records("death")) == 1
    assert scenario.standin.starts == starts + 1
    assert not strikes(run)
    assert len(run.of("worker-retry", reason="the service died")) >= 4
    assert_clean(scenario)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_stop_with_four_in_flight_then_a_rerun_finishes(
    scenario: Scenario, how: signal.Signals
) -> None:
    items = [f"ok {n}" for n in range(1, 7)]
    prepare(scenario, items, sleep="30 if iteration <= 4 else 0.2")
    # the operator's own branches: one of ralph-run's prefix, one of the name ralph-run would
    # give worker 1's first item; the clean-up after a kill -9 leaves both where they were
    theirs = ("ralph/mine", "ralph/ok-1-1")
    for branch in theirs:
        git(scenario.workspace, "branch", branch)
    mine = git(scenario.workspace, "rev-parse", "ralph/mine")
    run = scenario.start()
    all_in_flight(run, 4)
    run.send(how)
    run.wait(30)
    # the agents are gone (the tree guard kills them after a -9 too)
    wait_for(lambda: not scenario.agent_processes(), 10, "no agent left")
    if how == signal.SIGTERM:
        assert_clean(scenario, theirs)
        assert scenario.state()["status"] == "interrupted"
    again = scenario.start()
    assert again.wait() == 0, again.stderr
    assert scenario.marks() == ["x"] * 6
    assert not strikes(again)
    assert_clean(scenario, theirs)
    assert git(scenario.workspace, "rev-parse", "ralph/mine") == mine
    scenario.assert_nothing_left()


def test_pause_holds_the_run_between_attempts_and_resume_goes_on(scenario: Scenario) -> None:
    prepare(scenario, [f"ok {n}" for n in range(1, 5)], workers=2, sleep="1")
    run = scenario.start()
    all_in_flight(run, 2)
    assert ralph("pause", str(scenario.workspace)).returncode == 0
    paused = run.wait_event("paused", timeout=30)
    assert len(run.of("worker-landed")) == 2  # the attempts in flight ended first
    started = len(run.of("worker-started"))
    status = run.wait_status(lambda s: s.get("paused") is True, "the paused status")
    assert all(w["item"] is None for w in status["workers"])
    held_until = time.monotonic() + HELD_S  # nothing starts while paused: watched over a window
    while time.monotonic() < held_until:  # of several of the scheduler's rounds, not one look
        assert len(run.of("worker-started")) == started, run.events
        time.sleep(0.05)
    assert ralph("resume", str(scenario.workspace)).returncode == 0
    assert run.wait() == 0, run.stderr
    resumed = run.wait_event("resumed")
    between = run.events[run.events.index(paused) : run.events.index(resumed)]
    assert not [e for e in between if e["event"] == "worker-started"], between
    assert scenario.marks() == ["x"] * 4
    assert not strikes(run)
    assert_clean(scenario)


def test_a_usage_limit_holds_every_worker_until_its_reset_with_no_strike(
    scenario: Scenario,
) -> None:
    # strikes: 1: a limit counted as a failure would skip the item it hit
    prepare(scenario, [f"ok {n}" for n in range(1, 5)], workers=2,
            sleep="1.5 if iteration <= 2 else 0.1", checklist={"strikes": 1},
            limits={"default_wait": 4, "margin": 1})  # fmt: skip
    run = scenario.start()
    all_in_flight(run, 2)  # both think, then call: the server answers 429 for 2 s
    scenario.standin.trigger(rate_limit=2)
    first = run.wait_event("limited", timeout=20)
    assert first["source"] == "http-429"  # the stand-in agent prints the 429 it got
    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x"] * 4
    assert not strikes(run) and not run.of("skip")
    # nothing started from the first limit until its wait ended (the quota is shared)
    held = [e for e in run.of("worker-started") if first["time"] < e["time"] < first["until"]]
    assert held == [], (first, run.of("worker-started"))
    limited = run.of("iteration-ended", outcome="limited")
    assert limited, run.events
    assert scenario.state().get("limited") is None
    assert_clean(scenario)


def test_the_broken_agent_rule_compares_attempts_started_with_earlier_items_settled(
    scenario: Scenario,
) -> None:
    # every item fails the same way at once; worker 2's early attempts (an earlier item in
    # flight) are deferred, not compared; the first item is struck and skipped (strikes: 1),
    # the second, tried again once it is first, fails the same way: the agent is broken
    prepare(scenario, ["bad 1", "bad 2", "bad 3"], workers=2, sleep="0.2",
            checklist={"strikes": 1})  # fmt: skip
    run = scenario.start()
    assert run.wait() == 6, run.stderr
    broken = run.of("agent-broken")
    assert len(broken) == 1, run.events
    assert broken[0]["previous_item"] == "bad 1" and broken[0]["item"] == "bad 2"
    assert broken[0]["skipped"] == ["bad 1"]
    assert [e["item"] for e in strikes(run)] == ["bad 1"]
    assert run.of("worker-retry", waits=True)  # a deferred attempt was no failure to compare
    assert scenario.marks() == ["!", " ", " "]
    assert scenario.state()["status"] == "agent-broken"
    assert_clean(scenario)
    scenario.assert_nothing_left()


def test_each_attempts_receipt_counts_its_own_requests(scenario: Scenario) -> None:
    """With the agent proxy, each worker's agent has its own URL: overlapping attempts' history
    lines each count their own request, not every request made meanwhile."""
    prepare(scenario, [f"ok {n}" for n in range(1, 5)], workers=2, sleep="1",
            loop={"proxy": True})  # fmt: skip
    run = scenario.start()
    assert run.wait() == 0, run.stderr
    lines = [json.loads(line) for line in (scenario.workspace / ".ralph" / "iterations.jsonl")
             .read_text().splitlines()]  # fmt: skip
    assert len(lines) == 4
    spans = sorted((line["started"], line["started"] + line["seconds"]) for line in lines)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans
    assert [line["receipt"]["requests"] for line in lines] == [1, 1, 1, 1], lines
    assert {line["worker"] for line in lines} == {1, 2}
    receipts = run.of("receipt")
    assert sum(r["requests"] for r in receipts) == 4


def test_a_quiet_agent_is_idle_while_other_workers_keep_the_server_busy(
    scenario: Scenario,
) -> None:
    """`idle_timeout` with workers and the proxy: a worker's look at the service is its own
    requests in flight; the server kept busy by another worker does not keep a silent agent
    alive."""
    prepare(scenario, ["ok 1", "ok 2"], workers=2, sleep="30 if iteration == 1 else 0.1",
            loop={"proxy": True}, standin={"TOKENS_PER_SECOND": "2"})  # fmt: skip
    scenario.standin.trigger(busy=16)  # worker 2's call streams for 8 s
    data = yaml.safe_load(scenario.runbook_path.read_text())
    data["loop"]["steps"][1]["idle_timeout"] = 2
    scenario.runbook_path.write_text(yaml.safe_dump(data, sort_keys=False))
    run = scenario.start()
    assert run.wait() == 0, run.stderr
    stalled = run.of("strike", item="ok 1")
    assert stalled and "stalled (no output, no CPU" in stalled[0]["reason"], run.of("strike")
    # ... while worker 2's call still streamed (a run-wide look waited for its end)
    busy = run.of("step-done", step="run the agent", worker=2)
    assert busy and stalled[0]["time"] < busy[0]["time"], (stalled, busy)
    ended = run.of("iteration-ended", item="ok 2")
    assert ended and ended[0]["outcome"] == "done"
    assert scenario.marks() == ["x", "x"]


def test_a_restart_by_someone_else_under_two_attempts_is_one_death_no_strike(
    scenario: Scenario,
) -> None:
    """Someone restarts the server while both workers' calls stream (no check during the step:
    only the server's identity can tell): the calls fail, the first failed attempt's look
    finds another server: one death of its own, no recovery, no strike, both items land."""
    prepare(scenario, ["ok 1", "ok 2"], workers=2, sleep="0.1", watch=0, engine_probe=True,
            standin={"TOKENS_PER_SECOND": "2"})  # fmt: skip
    server = scenario.standin
    server.admin("busy", 16)  # each call streams for 8 s
    run = scenario.start()
    wait_for(lambda: len(scenario.agent_processes()) >= 4, 20, "both agents")  # shell + agent
    wait_for(lambda: metric_sum(server.get("/metrics").text, "vllm:num_requests_running") == 2,
             20, "both calls")  # fmt: skip
    starts = server.starts
    agents = scenario.agent_processes()
    for agent in agents:  # they learn of the restart only once the new server is up
        agent.send_signal(signal.SIGSTOP)
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    server.start(HEALTH_TIMEOUT="1")  # the restart by "someone else"
    for agent in agents:
        agent.send_signal(signal.SIGCONT)
    assert run.wait() == 0, run.stderr
    (death,) = scenario.records("death")
    assert death["fault"] == "restarted by someone else"
    assert server.starts == starts + 1  # ours only: the loop started nothing
    assert not strikes(run)
    assert scenario.marks() == ["x", "x"]
    assert_clean(scenario)


def test_a_line_that_looks_like_an_item_is_warned_of_with_workers_too(scenario: Scenario) -> None:
    """A checklist line that looks like an item but is not (`-[ ]`, no space) is said once, at
    the start, whether one worker or many run the items: the pool once said nothing."""
    prepare(scenario, ["ok 1", "ok 2"], workers=2)
    path = scenario.workspace / "CHECKLIST.md"
    path.write_text(path.read_text() + "-[ ] ok 3, not an item\n")
    git(scenario.workspace, "commit", "-qam", "a near miss")
    run = scenario.start()
    assert run.wait() == 0, run.stderr
    warned = [e["message"] for e in run.of("warning") if "like an item" in e["message"]]
    assert len(warned) == 1 and "line 3" in warned[0], run.of("warning")
    assert scenario.marks() == ["x", "x"]
