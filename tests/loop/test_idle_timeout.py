"""`idle_timeout`: a loop step whose whole tree printed nothing, used no CPU, changed nothing in
the workdir while the server had no request in flight for that long is killed as *stalled*, a
strike (no death), and stalls count toward the broken-agent rule; a step that prints, computes,
writes files or waits on a request the server is processing is never killed.

Real processes: execute.run with the loop's watch (loop/idle.py), and ralph-run end to end on
the stand-in server.
"""

from __future__ import annotations

import contextlib
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from support.e2e import AGENT_STEP, Scenario, make_workspace
from support.standin import process_gone, wait_for

from ralph_runner import cli
from ralph_runner.loop import failures, idle
from ralph_runner.loop.idle import StepIdle
from ralph_runner.process import execute

pytestmark = pytest.mark.timeout(120)

IDLE = 3.0  # the idle_timeout of these tests
SLACK = 4.0  # seconds a stall may take to be seen and killed beyond it (a loaded 2-core box)
STATUS = f"stalled ({idle.reason(IDLE)})"


def pid_in(pid_file: Path) -> int:
    return int(wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 5, "a pid"))


# -- the watch on real processes, through execute.run -------------------------------------


def test_a_blocked_tree_is_killed_within_idle_timeout_whole(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    command = f"sleep 1000 & echo $! > {pid_file}; wait"
    started = time.monotonic()
    result = execute.shell(command, cwd=tmp_path, timeout=60, idle=StepIdle(IDLE, tmp_path, None))
    took = time.monotonic() - started
    assert result.stalled == idle.reason(IDLE)
    assert not result.ok and not result.timed_out and not result.cancelled
    assert result.exit_code is None
    assert IDLE <= took < IDLE + SLACK, took
    grandchild = pid_in(pid_file)
    wait_for(lambda: process_gone(grandchild), 5, "the sleep under the shell gone")


@pytest.mark.parametrize(
    "what, command",
    [
        ("prints every second", "for i in 1 2 3 4 5 6 7; do echo $i; sleep 1; done"),
        ("burns CPU", "end=$((SECONDS+7)); while [ $SECONDS -lt $end ]; do :; done"),
        ("starts a process every second", "for i in 1 2 3 4 5 6 7; do sleep 1; done"),
    ],
)
def test_a_working_tree_is_not_killed(tmp_path: Path, what: str, command: str) -> None:
    result = execute.shell(command, cwd=tmp_path, timeout=60, idle=StepIdle(IDLE, tmp_path, None))
    assert result.ok, (what, result)
    assert result.seconds > IDLE + 2


def test_files_changing_in_the_workdir_keep_a_silent_tree_alive(tmp_path: Path) -> None:
    """A writer outside the tree (a container, a daemon the agent drives): only the workdir
    shows the work. Once it stops, the step is stalled."""
    deep = tmp_path / "src" / "pkg"
    deep.mkdir(parents=True)
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.wait(0.7):
            n += 1
            (deep / "module.py").write_text(f"x = {n}\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    threading.Timer(IDLE + 4, stop.set).start()
    started = time.monotonic()
    try:
        result = execute.shell(
            "sleep 1000", cwd=tmp_path, timeout=60, idle=StepIdle(IDLE, tmp_path, None)
        )
    finally:
        stop.set()
    took = time.monotonic() - started
    assert result.stalled, result
    assert IDLE + 4 + IDLE <= took < IDLE + 4 + IDLE + SLACK, took


def test_ralph_runs_own_files_are_no_work(tmp_path: Path) -> None:
    store = tmp_path / ".ralph"
    store.mkdir()
    stop = threading.Event()

    def write() -> None:
        while not stop.wait(0.5):
            (store / "status.json").write_text(str(time.time()))

    threading.Thread(target=write, daemon=True).start()
    try:
        watch = StepIdle(IDLE, tmp_path, None, ignore=[store])
        result = execute.shell("sleep 1000", cwd=tmp_path, timeout=60, idle=watch)
    finally:
        stop.set()
    assert result.stalled and result.seconds < IDLE + SLACK, result


def test_a_request_on_the_server_keeps_a_silent_tree_alive(tmp_path: Path) -> None:
    """The server says busy (maybe our request): no kill; from when it goes idle, idle_timeout
    more seconds and the step is stalled."""
    busy = threading.Event()
    busy.set()
    threading.Timer(IDLE + 5, busy.clear).start()
    started = time.monotonic()
    watch = StepIdle(IDLE, tmp_path, busy.is_set)
    result = execute.shell("sleep 1000", cwd=tmp_path, timeout=60, idle=watch)
    took = time.monotonic() - started
    assert result.stalled, result
    assert IDLE + 5 + IDLE - 1 <= took < IDLE + 5 + IDLE + idle.SERVER_EVERY + SLACK, took


def test_a_server_that_cannot_be_asked_is_busy(tmp_path: Path) -> None:
    def broken() -> bool:
        raise RuntimeError("no /metrics")

    watch = StepIdle(IDLE, tmp_path, broken)
    result = execute.shell("sleep 8", cwd=tmp_path, timeout=60, idle=watch)
    assert result.ok, result


def test_status_and_signature_of_a_stall() -> None:
    assert failures.status_text(None, False, False, "", idle.reason(120)) == (
        "stalled (no output, no CPU, no change for 120 s)"
    )
    one = failures.signatures("agent", STATUS, "thinking about a", "a", from_process=True,
                              at_once_untouched=False, stalled=True)  # fmt: skip
    two = failures.signatures("agent", STATUS, "reading b.py", "b", from_process=True,
                              at_once_untouched=False, stalled=True)  # fmt: skip
    assert set(one) & set(two), "two stalls of one step are the same failure"


# -- the runbook key ----------------------------------------------------------------------

RUNBOOK = """\
name: t
health:
  probes:
    - name: models
      http: {{ url: "http://127.0.0.1:9/v1/models" }}
diagnostics:
  collect:
    - name: ps
      shell: ps
      {collector}
loop:
  steps:
    - ensure_alive: {{ phase: start }}
    - name: agent
      shell: echo {{{{ item.text }}}}
      idle_timeout: 120
      {agent}
    - verify: {{}}
      {verify}
"""


def check(tmp_path: Path, capsys, **extra: str) -> tuple[int, str]:
    """--check from a workdir the run would accept (a git repository with its CHECKLIST.md)."""
    keys = {"collector": "", "agent": "", "verify": "", **extra}
    path = tmp_path / "runbook.yaml"
    path.write_text(textwrap.dedent(RUNBOOK.format(**keys)))
    work = tmp_path / "work"
    if not work.exists():
        make_workspace(work, ["one"])
    with contextlib.chdir(work), pytest.raises(SystemExit) as exit_info:
        cli.main([str(path), "--check"])
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out + captured.err


def test_check_shows_idle_timeout(tmp_path: Path, capsys) -> None:
    code, out = check(tmp_path, capsys)
    assert code == 0, out
    assert "idle_timeout: 120" in out


@pytest.mark.parametrize(
    "where, line, phrase",
    [
        ("collector", 10, "watches loop steps only, not the tasks of diagnostics.collect"),
        ("verify", 19, "'verify' runs none"),
    ],
)
def test_idle_timeout_elsewhere_is_refused_at_its_line(
    tmp_path: Path, capsys, where: str, line: int, phrase: str
) -> None:
    code, out = check(tmp_path, capsys, **{where: "idle_timeout: 60"})
    assert code == 2, out
    assert f"runbook.yaml:{line}:" in out and phrase in out, out


def test_idle_timeout_must_be_positive(tmp_path: Path, capsys) -> None:
    code, out = check(tmp_path, capsys, agent="timeout: 600\n      retries: 0")
    assert code == 0, out
    path = tmp_path / "runbook.yaml"
    path.write_text(path.read_text().replace("idle_timeout: 120", "idle_timeout: 0"))
    with contextlib.chdir(tmp_path / "work"), pytest.raises(SystemExit) as exit_info:
        cli.main([str(path), "--check"])
    assert exit_info.value.code == 2
    assert "greater than 0" in capsys.readouterr().err


# -- end to end: ralph-run on the stand-in ------------------------------------------------


def prepare(scenario: Scenario, items: list[str], strikes: int = 3, **settings) -> None:
    scenario.prepare(items, engine_probe=True, step_timeout=60, agent_timeout=60, **settings)
    book = yaml.safe_load(scenario.runbook_path.read_text())
    (agent,) = [step for step in book["loop"]["steps"] if step.get("name") == AGENT_STEP]
    agent["idle_timeout"] = IDLE
    book["checklist"]["strikes"] = strikes
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))


def test_a_stalled_agent_is_a_strike_and_stalls_on_two_items_a_broken_agent(
    scenario: Scenario,
) -> None:
    # the stand-in agent prints its first line, then "thinks" for 1000 s: nothing moves
    prepare(scenario, ["first thing", "second thing"], strikes=1, agent_sleep="1000",
            after_agent="true")  # fmt: skip
    run = scenario.start()
    run.wait_agent(1)
    tree = scenario.wait_agent_tree()
    done = run.wait_event("step-done", timeout=IDLE + 20, step=AGENT_STEP)
    assert done["stalled"] is True and done["status"] == STATUS, done
    assert done["seconds"] < IDLE + SLACK, done
    for process in tree:
        wait_for(lambda p=process: process_gone(p.pid), 5, f"{process.pid} gone")
    strike = run.wait_event("strike", item="first thing")
    assert f"{AGENT_STEP}: {STATUS}" in strike["reason"], strike
    assert run.wait(60) == 6, run.events
    broken = run.of("agent-broken")[0]
    assert broken["item"] == "second thing" and STATUS in broken["reason"], broken
    assert scenario.records("death") == [] and not run.of("death"), run.events
    assert scenario.marks() == ["!", " "]
    scenario.assert_nothing_left()


def test_an_agent_waiting_on_a_long_generation_is_not_killed(scenario: Scenario) -> None:
    """The stand-in streams slowly: the agent is all but silent while its request runs, and
    the server's active request keeps it alive past idle_timeout."""
    prepare(scenario, ["slow thing"], agent_sleep="2")
    run = scenario.start()
    run.wait_agent(1)
    scenario.standin.admin("tokens_per_second", 2).raise_for_status()
    scenario.standin.admin("busy", 30).raise_for_status()  # seconds of tokens, > IDLE + 4
    done = run.wait_event("step-done", timeout=60, step=AGENT_STEP)
    scenario.standin.admin("busy", 0)
    scenario.standin.admin("tokens_per_second", 1000)
    assert done["ok"], f"{done} {run.of('watch')} {run.of('death')[:1]}"
    assert done["seconds"] > IDLE + 4, done
    assert run.wait(60) == 0, run.events
    assert not run.of("strike") and scenario.marks() == ["x"], run.events
    scenario.assert_nothing_left()
