"""`loop.workers: N`: items at once in git worktrees, against the stand-in server (real git,
real processes): landings, conflicts retried, order, one death for all, stops and reruns.

The agent step is the stand-in agent (one streamed call to the stand-in, nothing ticked:
`--checklist /dev/null`) followed by WORK, a shell script that does the item's work by its first
word, ticks the item in hand (not the first one) and commits, as a real agent in a worktree does.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import AGENT_STEP, RalphRun, Scenario, make_workspace, runbook
from standin_helpers import ralph, wait_for

pytestmark = pytest.mark.timeout(120)

WORK = r"""#!/bin/bash
# $1: the item's text. Its first word says what to do.
item=$1 word=${1%% *}
case "$word" in
  ok|slow) echo "$item" > "$(echo "$item" | tr ' ' _).txt" ;;
  same) echo "$item" > shared.txt ;;  # every `same` item rewrites the same line
  needs)  # needs the file of the item named after it
    wanted="$(echo "${item#needs }" | tr ' ' _).txt"
    [ -e "$wanted" ] || { echo "missing $wanted" >&2; exit 1; }
    echo "$item" > "$(echo "$item" | tr ' ' _).txt" ;;
  *) echo "unknown item: $item" >&2; exit 2 ;;
esac
sed -i "s/^- \[ \] $item\$/- [x] $item/" CHECKLIST.md
git add -A && git commit -qm "work: $item"
"""


def prepare(
    scenario: Scenario,
    items: list[str],
    *,
    workers: int = 4,
    sleep: str = "0.3",
    **changes: dict[str, Any],
) -> Scenario:
    """The workspace (with shared.txt), a runbook with `workers` whose agent is WORK; `changes`:
    top-level runbook sections (checklist, limits)."""
    work = scenario.root / "work.sh"
    work.write_text(WORK)
    work.chmod(0o755)
    make_workspace(scenario.workspace, items)
    (scenario.workspace / "shared.txt").write_text("base\n")
    git(scenario.workspace, "add", "shared.txt")
    git(scenario.workspace, "commit", "-qm", "shared")
    data = runbook(watch=0.3, max_iterations=0)
    agent = (
        "{{ python }} -m ralph_runner.standin.agent --url {{ base_url }} --model {{ model }}"
        f" --timeout 5 --checklist /dev/null --no-commit --sleep {{{{ {sleep} }}}} -- x"
        f" && {work} {{{{ item.text | quote }}}}"
    )
    data["loop"]["workers"] = workers
    data["loop"]["steps"][1]["shell"] = agent
    data.update(changes)
    scenario.runbook_path.write_text(yaml.safe_dump(data, sort_keys=False))
    scenario.standin.start(HEALTH_TIMEOUT="1")
    return scenario


def git(work: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=work, capture_output=True, text=True, check=True)
    return done.stdout


def strikes(run: RalphRun) -> list[dict[str, Any]]:
    return run.of("strike")


def in_flight_at_most(run: RalphRun) -> int:
    """The most attempts in flight at once, by the events: started, then ended."""
    now = most = 0
    for event in run.events:
        if event["event"] == "worker-started":
            now += 1
            most = max(most, now)
        elif event["event"] == "iteration-ended":
            now -= 1
    return most


def assert_clean(scenario: Scenario, theirs: tuple[str, ...] = ()) -> None:
    """No worktree but the workdir's, no ralph/* branch but the operator's (`theirs`), nothing
    under .ralph/worktrees."""
    work = scenario.workspace
    trees = [ln for ln in git(work, "worktree", "list", "--porcelain").splitlines()
             if ln.startswith("worktree ")]  # fmt: skip
    assert trees == [f"worktree {work}"], trees
    branches = git(work, "branch", "--format=%(refname:short)", "--list", "ralph/*").split()
    assert sorted(branches) == sorted(theirs)
    where = work / ".ralph" / "worktrees"
    assert not where.exists() or not any(where.iterdir())
    assert git(work, "status", "--porcelain").strip() == ""


def all_in_flight(run: RalphRun, count: int) -> dict[str, Any]:
    """The status once `count` workers run their agent step."""

    def running(status: dict[str, Any]) -> bool:
        workers = status.get("workers") or []
        return sum(1 for w in workers if w["phase"] == AGENT_STEP) >= count

    return run.wait_status(running, f"{count} agents in flight", timeout=30)


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


def test_an_item_that_needs_the_one_before_lands_after_it(scenario: Scenario) -> None:
    # the first item thinks longer: the second, started at once, fails first and waits
    prepare(scenario, ["slow one", "needs slow one"], workers=2,
            sleep="2 if item.index == 0 else 0.1")  # fmt: skip
    run = scenario.start()
    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x", "x"]
    assert not strikes(run)
    retried = run.of("worker-retry", item="needs slow one")
    assert retried and retried[0]["waits"] is True
    landed = [e["item"] for e in run.of("worker-landed")]
    assert landed == ["slow one", "needs slow one"]
    assert_clean(scenario)


def test_a_death_with_four_in_flight_is_one_death_one_restart(scenario: Scenario) -> None:
    prepare(scenario, [f"ok {n}" for n in range(1, 7)], sleep="3 if iteration <= 4 else 0.2")
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
    assert len(run.of("worker-started")) == started  # nothing starts while paused
    assert ralph("resume", str(scenario.workspace)).returncode == 0
    assert run.wait() == 0, run.stderr
    assert paused and run.of("resumed")
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
