"""What an agent leaves running is killed when its step ends (issue 29, finding 7): a step that
backgrounded a child, double-forked one, or moved one to a session of its own with `setsid`,
and exited 0, left them all running after ralph-run exited, once per iteration. Now they are
killed at the step's end, and a warning says which; a recovery's server (started with setsid by
its step, on purpose) stays up."""

from __future__ import annotations

import json
import re
import secrets
import sys

import psutil
import pytest
from support.e2e import AGENT_STEP, RalphRun, Scenario, runbook

pytestmark = pytest.mark.timeout(120)

STEP = "leaves children behind"
# three leftovers, each its own way; the sleeps' lengths, with a token of this run's own in their
# fraction, tell them apart from any other sleep on the machine (another checkout's run of this
# test too: only this run's are matched, and killed if the test fails)
TOKEN = secrets.randbelow(10**8)
LENGTHS = tuple(f"{whole}.{TOKEN:08d}" for whole in (1001, 1002, 1003))
LEAVER = (
    f"sleep {LENGTHS[0]} & "  # backgrounded: same session, re-parented to init when sh exits
    f"sh -c 'sleep {LENGTHS[1]} & exit 0'; "  # a double fork
    f"setsid sh -c 'exec sleep {LENGTHS[2]}' & "  # a session of its own
    "exit 0"
)


def _sleeps() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline[:1] == ["sleep"] and any(length in cmdline for length in LENGTHS):
            found.append(process)
    return found


def test_a_step_that_exits_0_leaves_nothing_running(scenario: Scenario) -> None:
    scenario.prepare(["one item", "two items"], agent_sleep="1.0")
    document = runbook()
    document["loop"]["steps"].insert(1, {"name": STEP, "shell": LEAVER})
    scenario.runbook_path.write_text(json.dumps(document))
    command = [sys.executable, "-m", "ralph_runner", str(scenario.runbook_path), "--json"]
    run = RalphRun([*command, "-e", json.dumps(scenario.facts)], scenario.workspace)
    scenario.runs.append(run)
    try:
        done = run.wait_event("step-done", 60, step=STEP)
        assert done["ok"] is True, done
        warning = run.wait_event("warning", 10)["message"]
        # each sleep was there, and is gone before the next step runs
        pids = [int(pid) for pid in re.findall(r"sleep \(pid (\d+)\)", warning)]
        assert len(pids) == 3, warning
        assert warning.startswith(f"{STEP} left 3 processes running: killed "), warning
        run.wait_event("step", 20, step=AGENT_STEP)
        assert not [p for p in _sleeps() if p.status() != psutil.STATUS_ZOMBIE], warning
        scenario.standin.trigger(die=True)  # the recovery starts a server, setsid, on purpose
        assert run.wait(90) == 0, run.stderr
        assert len(run.of("recovery", recovered=True)) == 1, run.events
        warnings = [w["message"] for w in run.of("warning")]  # once per iteration, each alike
        assert len(warnings) >= 2 and all(w.startswith(f"{STEP} left 3 ") for w in warnings)
        assert scenario.standin.healthy(), "the server the recovery started was killed"
    finally:
        for process in _sleeps():
            process.kill()
