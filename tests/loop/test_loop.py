"""The loop engine end to end: `ralph-run` as a subprocess on a real git repository, with a
stand-in coding agent (a bash script whose behaviour the item's first word picks).

Checklist, strikes and skips, verify, timeouts and signals that kill whole process trees, the
lock, resuming after SIGKILL, exit codes, --json and the human view, `status` and `deaths`.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from support.standin import process_gone, wait_for

pytestmark = pytest.mark.timeout(60)

RALPH = [sys.executable, "-m", "ralph_runner"]

# The stand-in agent. Its attempt number at an item is how often the item reached it so far.
AGENT = r"""#!/bin/bash
log=$1 item=$2
echo "$item" >> "$log"
attempt=$(grep -cxF -- "$item" "$log")
tick() { sed -i '0,/^- \[ \] /s//- [x] /' CHECKLIST.md; }
commit() { git commit -qam "done: $item"; }
hang() {  # grandchildren: a plain one, one in its own session, one orphaned into our group
  "$PY" -c 'import time; time.sleep(300)' "$item" &
  setsid "$PY" -c 'import time; time.sleep(300)' "$item" &
  ( "$PY" -c 'import time; time.sleep(300)' "$item" & )
  wait
}
case "$item" in
  ok*) tick; commit ;;
  lazy*) echo "half-done: $item" >> PLAN.md ;;  # works, never ticks, never commits
  tick-only*) tick ;;
  commit-only*) echo "$item" >> work.txt; git add work.txt; git commit -qm "work: $item" ;;
  dirty*) tick; commit; echo junk > junk.txt ;;
  rewrite*) sed -i 's/^- \[ \] rewrite me$/- [ ] rewritten by the agent/' CHECKLIST.md; exit 1 ;;
  jam-state*) rm -f .ralph/state.json; mkdir .ralph/state.json; tick; commit ;;  # as a full disk
  hang-once*) if [ "$attempt" = 1 ]; then hang; else tick; commit; fi ;;
  hang*) hang ;;
  die-once*) if [ "$attempt" = 1 ]; then rm -f "$ALIVE"; exit 1; fi; tick; commit ;;
  flaky*)
    case $attempt in
      1) rm -f "$ALIVE"; exit 1 ;;  # the service dies under it: retried, no strike
      2) exit 1 ;;                  # a plain failure: strike 1
      3) hang ;;                    # ralph-run gets killed here
      *) tick; commit ;;
    esac ;;
  *) echo "unknown item: $item" >&2; exit 2 ;;
esac
"""

RUNBOOK = """
name: loop test
workdir: work
vars:
  agent: "{{ runbook_dir }}/agent.sh"
  log: "{{ runbook_dir }}/agent.log"
  alive: "{{ runbook_dir }}/alive"
checklist: { path: CHECKLIST.md, strikes: 3 }
prompt: "Do exactly this, tick it, commit: {{ item.text }}"
loop:
  max_iterations: 0
  steps:
    - name: agent
      shell: "{{ agent }} {{ log }} {{ item.text }}"
      env: { ALIVE: "{{ alive }}" }
      timeout: 20
    - verify: { checked: true, committed: true }
"""

# A service that is "alive" while a file exists: the agent removes it, recovery touches it.
SERVICE = """
health:
  probes:
    - name: alive file
      command: "test -e {{ alive }}"
      timeout: 1
  failures_before_dead: 1
  interval: 0.1
diagnostics:
  log: logs/deaths.log
  collect:
    - name: checklist
      shell: cat CHECKLIST.md
recovery:
  steps:
    - name: bring it back
      shell: "touch {{ alive }}"
  attempts: 1
  healthy_within: 2
"""


# -- helpers -----------------------------------------------------------------------------------
def git(work: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=work, capture_output=True, text=True, check=True)
    return done.stdout


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def events(stdout: str) -> list[dict[str, Any]]:
    """Every line of --json output parsed; fails on a line that is not one JSON event."""
    parsed = [json.loads(line) for line in stdout.splitlines()]
    assert all(isinstance(e, dict) and isinstance(e.get("event"), str) for e in parsed), stdout
    return parsed


def of_kind(all_events: list[dict], kind: str) -> list[dict]:
    return [e for e in all_events if e["event"] == kind]


def marked(marker: str) -> list[psutil.Process]:
    """Live processes whose command line holds `marker` (zombies count as gone)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if marker in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


def kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    wait_for(lambda: all(process_gone(p.pid) for p in processes), 5, "killed processes to end")


class Loop:
    """One test's workspace: git repo `work/`, agent, runbook; runs ralph-run from tmp_path."""

    def __init__(self, tmp_path: Path, marker: str) -> None:
        self.root, self.marker = tmp_path, marker
        self.work = tmp_path / "work"
        self.runbook = tmp_path / "runbook.yaml"
        self.state_path = self.work / ".ralph" / "state.json"
        self.status_path = self.work / ".ralph" / "status.json"
        self.started: list[subprocess.Popen] = []
        agent = tmp_path / "agent.sh"
        agent.write_text(AGENT.replace('"$PY"', f'"{sys.executable}"'))
        agent.chmod(0o755)
        (tmp_path / "alive").touch()

    def setup(self, items: list[str], service: bool = False, **changes: Any) -> Loop:
        self.work.mkdir()
        (self.work / "PLAN.md").write_text("# Plan\n")
        (self.work / "CHECKLIST.md").write_text(
            "# Checklist\n\n" + "".join(f"- [ ] {i}\n" for i in items)
        )
        git(self.work, "init", "-q", "-b", "main")
        git(self.work, "config", "user.email", "t@example.com")
        git(self.work, "config", "user.name", "t")
        git(self.work, "add", "-A")
        git(self.work, "commit", "-qm", "init")
        data = yaml.safe_load(RUNBOOK)
        if service:
            data.update(yaml.safe_load(SERVICE))
        self.runbook.write_text(yaml.safe_dump(merged(data, changes), sort_keys=False))
        return self

    def run(self, *args: str, json_lines: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [*RALPH, str(self.runbook), *(["--json"] if json_lines else []), *args]
        return subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=45)

    def command(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*RALPH, *args], cwd=self.root, capture_output=True, text=True, timeout=20
        )

    def start(self) -> subprocess.Popen[str]:
        argv = [*RALPH, str(self.runbook), "--json"]
        process = subprocess.Popen(
            argv, cwd=self.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.started.append(process)
        return process

    def hanging(self, count: int = 4) -> list[psutil.Process]:
        """Waits until the hanging agent and its grandchildren are all up."""
        return wait_for(
            lambda: (found := marked(self.marker)) and len(found) >= count and found,
            15,
            "the agent's tree",
        )

    def checklist(self) -> str:
        return (self.work / "CHECKLIST.md").read_text()

    def state(self) -> dict[str, Any]:
        return json.loads(self.state_path.read_text())

    def attempts(self, item: str) -> int:
        return (self.root / "agent.log").read_text().splitlines().count(item)

    def close(self) -> list[psutil.Process]:
        """Ends what a test left running; the processes of its agents that were still alive."""
        for process in self.started:
            if process.poll() is None:
                process.kill()
            process.communicate()
        leftovers = marked(self.marker)
        kill_all(leftovers)
        return leftovers


@pytest.fixture
def loop(tmp_path):
    marker = f"m{uuid.uuid4().hex[:12]}"
    workspace = Loop(tmp_path, marker)
    yield workspace
    assert workspace.close() == [], "a test left agent processes behind"


# -- the checklist ---------------------------------------------------------------------------
def test_twenty_items_finish_with_one_commit_each(loop):
    loop.setup([f"ok item {n}" for n in range(1, 21)])
    done = loop.run()
    assert done.returncode == 0, done.stderr
    assert loop.checklist().count("- [x] ") == 20 and "- [ ]" not in loop.checklist()
    assert git(loop.work, "rev-list", "--count", "HEAD").strip() == "21"
    all_events = events(done.stdout)
    assert [e["iteration"] for e in of_kind(all_events, "iteration")] == list(range(1, 21))
    assert len(of_kind(all_events, "done")) == 20 and not of_kind(all_events, "strike")
    (summary,) = of_kind(all_events, "summary")
    assert summary["iterations"] == 20 and summary["done"] == 20
    assert summary["todo"] == summary["skipped"] == summary["deaths"] == 0
    assert summary["stopped_at_max"] is False
    assert all(isinstance(e["time"], float) for e in all_events)


def test_an_agent_that_never_commits_is_skipped_after_its_strikes(loop):
    loop.setup(["lazy item", "ok next item"])
    done = loop.run()
    assert done.returncode == 0, done.stderr
    assert loop.attempts("lazy item") == 3 and loop.attempts("ok next item") == 1
    assert "- [!] lazy item\n- [x] ok next item\n" in loop.checklist()
    subjects = git(loop.work, "log", "--format=%s").splitlines()
    assert subjects == ["done: ok next item", "skip: lazy item (3 failures)", "init"]
    # the skip commit holds the checklist only, not the agent's half-done work
    assert git(loop.work, "show", "--name-only", "--format=", "HEAD~1").split() == ["CHECKLIST.md"]
    all_events = events(done.stdout)
    strikes = of_kind(all_events, "strike")
    assert [(s["item"], s["strikes"], s["of"]) for s in strikes] == [
        ("lazy item", n, 3) for n in (1, 2, 3)
    ]
    assert "item not ticked" in strikes[0]["reason"] and "no new commit" in strikes[0]["reason"]
    assert [e["attempts"] for e in of_kind(all_events, "iteration")] == [0, 1, 2, 0]
    assert [(e["item"], e["strikes"]) for e in of_kind(all_events, "skip")] == [("lazy item", 3)]
    (summary,) = of_kind(all_events, "summary")
    assert (summary["iterations"], summary["done"], summary["skipped"]) == (4, 1, 1)


def test_a_state_file_that_cannot_be_written_is_reported_and_the_loop_goes_on(loop):
    loop.setup(["jam-state now", "ok after", "ok last"])
    done = loop.run()
    assert done.returncode == 0, done.stderr
    warnings = of_kind(events(done.stdout), "warning")
    assert warnings and "state not saved" in warnings[0]["message"]
    assert loop.checklist().count("- [x] ") == 3


def test_an_item_whose_line_the_agent_rewrote_is_struck_without_a_skip_commit(loop):
    loop.setup(["rewrite me", "ok after"], checklist={"path": "CHECKLIST.md", "strikes": 1})
    done = loop.run()
    assert done.returncode == 0, done.stderr  # not a crash on "nothing to commit"
    skipped = [e["item"] for e in of_kind(events(done.stdout), "skip")]
    assert skipped == ["rewrite me", "rewritten by the agent"]  # the new line is a new item
    subjects = git(loop.work, "log", "--format=%s").splitlines()
    assert "skip: rewrite me (1 failures)" not in subjects  # its line is gone: nothing to mark
    assert "skip: rewritten by the agent (1 failures)" in subjects
    assert "- [!] rewritten by the agent" in loop.checklist()


def test_max_iterations_with_items_left_exits_5_and_the_human_view_is_plain(loop):
    loop.setup(["ok one", "ok two", "ok three"], loop={"max_iterations": 2})
    done = loop.run(json_lines=False)
    assert done.returncode == 5, done.stderr
    assert loop.checklist().count("- [x] ") == 2 and "- [ ] ok three" in loop.checklist()
    assert "\x1b" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert all(re.fullmatch(r"\[\d\d:\d\d:\d\d\] .*\S", line) for line in lines), lines
    prompt = "Do exactly this, tick it, commit: ok two"
    assert any(
        f"] iteration 2: ok two  (strikes 0, prompt {len(prompt)} chars" in line for line in lines
    )
    assert (
        "stopped at max_iterations: 2 iterations, 2 done, 1 todo, 0 skipped, 0 deaths" in lines[-1]
    )


# -- verify ------------------------------------------------------------------------------------
def test_verify_needs_the_tick_the_commit_and_a_clean_tree(loop):
    loop.setup(
        ["tick-only item", "commit-only item", "ok item", "dirty item"], checklist={"strikes": 1}
    )
    done = loop.run()
    assert done.returncode == 0, done.stderr
    reasons = {s["item"]: s["reason"] for s in of_kind(events(done.stdout), "strike")}
    assert reasons.keys() == {"tick-only item", "commit-only item", "dirty item"}
    assert reasons["tick-only item"] == "verify: no new commit"
    assert reasons["commit-only item"] == "verify: item not ticked"
    assert reasons["dirty item"] == "verify: uncommitted changes"
    assert (
        "- [!] tick-only item\n- [!] commit-only item\n- [x] ok item\n- [!] dirty item\n"
        in loop.checklist()
    )


def test_a_death_is_no_strike_and_ralph_runs_files_never_dirty_the_tree(loop):
    loop.setup(["die-once item"], service=True)
    done = loop.run()
    assert done.returncode == 0, done.stderr
    all_events = events(done.stdout)
    assert not of_kind(all_events, "strike")
    (death,) = of_kind(all_events, "death")
    assert death["phase"] == "after-failure" and death["reason"].startswith("alive file: status")
    assert [r["recovered"] for r in of_kind(all_events, "recovery")] == [True]
    assert [e["event"] for e in all_events if e["event"] in ("retry", "done")] == ["retry", "done"]
    # the second attempt's verify passed although the death log, its twin and .ralph/ lie in
    # the repository: they are excluded from git, not committed
    assert (loop.work / "logs" / "deaths.log").is_file() and (loop.work / ".ralph").is_dir()
    records = [
        json.loads(line) for line in (loop.work / "logs" / "deaths.jsonl").read_text().splitlines()
    ]
    assert [r["event"] for r in records] == ["death", "recovery"]
    assert git(loop.work, "status", "--porcelain", "--ignored=no") == ""
    assert git(loop.work, "ls-files").split() == ["CHECKLIST.md", "PLAN.md"]

    for target in (str(loop.runbook), str(loop.work / "logs" / "deaths.jsonl")):
        deaths = loop.command("deaths", target)
        assert deaths.returncode == 0, deaths.stderr
        (first,) = [line for line in deaths.stdout.splitlines() if line.startswith("  #1 ")]
        assert "after-failure" in first and "probe alive file: status" in first
        assert "recovered in" in first and first.endswith("die-once item")
        assert "1 death over 2 iterations on 1 host" in deaths.stdout  # the retry is one


# -- processes -------------------------------------------------------------------------------
def test_a_step_timeout_kills_the_whole_tree_and_is_a_strike(loop):
    item = f"hang {loop.marker}"
    loop.setup(
        [item, "ok after"],
        checklist={"strikes": 1},
        loop={
            "steps": [
                {"name": "agent", "shell": "{{ agent }} {{ log }} {{ item.text }}", "timeout": 2},
                {"verify": {"checked": True, "committed": True}},
            ]
        },
    )
    process = loop.start()
    loop.hanging()
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    wait_for(lambda: not marked(loop.marker), 5, "the agent's tree to be gone")
    (strike,) = of_kind(events(stdout), "strike")
    assert strike["item"] == item and strike["reason"] == "agent: timed out"
    (step,) = [e for e in of_kind(events(stdout), "step-done") if not e["ok"]]
    assert step["timed_out"] and 2 <= step["seconds"] < 8
    assert f"skip: {item} (1 failures)" in git(loop.work, "log", "--format=%s")


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_step_stops_cleanly_and_the_run_resumes(loop, signum, code):
    item = f"hang-once {loop.marker}"
    loop.setup([item, "ok after"])
    process = loop.start()
    loop.hanging()
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=15)
    assert process.returncode == code, stderr
    wait_for(lambda: not marked(loop.marker), 5, "the agent's tree to be gone")
    assert of_kind(events(stdout), "interrupted")[0]["exit_code"] == code
    saved = loop.state()
    assert saved["status"] == "interrupted" and saved["iteration"] == 1
    assert saved["current_item"] == item and saved["strikes"] == {}
    assert "Traceback" not in stderr

    resumed = loop.run()
    assert resumed.returncode == 0, resumed.stderr
    all_events = events(resumed.stdout)
    (resume,) = of_kind(all_events, "resume")
    assert (resume["iteration"], resume["item"]) == (1, item)
    first = of_kind(all_events, "iteration")[0]
    assert (first["iteration"], first["item"], first["attempts"]) == (2, item, 0)  # no strike
    assert loop.state()["status"] == "finished"


def test_kill_9_then_restart_resumes_with_the_same_counters(loop):
    item = f"flaky {loop.marker}"
    loop.setup([item, "ok after"], service=True)
    process = loop.start()
    loop.hanging()  # the third attempt hangs: one death and one strike are behind it
    before = loop.state()
    assert (before["iteration"], before["strikes"], before["deaths"]) == (3, {item: 1}, 1)
    assert before["status"] == "running" and before["pid"] == process.pid
    assert before["current_item"] == item
    process.kill()
    process.communicate(timeout=10)
    lock = loop.work / ".ralph" / "lock"
    assert lock.read_text().strip() == str(process.pid)  # the stale lock of the killed run
    # the agent's tree dies with ralph-run (test_agent_tree.py measures how fast)
    wait_for(lambda: not marked(loop.marker), 5, "the agent's tree to be gone")

    status = loop.command("status", str(loop.work))
    assert status.returncode == 0, status.stderr
    assert f"not running: pid {process.pid} is gone" in status.stdout

    restarted = loop.run()
    assert restarted.returncode == 0, restarted.stderr
    assert not marked(loop.marker)
    all_events = events(restarted.stdout)
    (resume,) = of_kind(all_events, "resume")
    assert (resume["iteration"], resume["deaths"], resume["item"]) == (3, 1, item)
    first = of_kind(all_events, "iteration")[0]
    assert (first["iteration"], first["item"], first["attempts"]) == (4, item, 1)
    (summary,) = of_kind(all_events, "summary")
    assert (summary["iterations"], summary["done"], summary["deaths"]) == (5, 2, 1)
    after = loop.state()
    assert (after["iteration"], after["strikes"], after["deaths"]) == (5, {}, 1)
    assert after["status"] == "finished" and len(after["death_times"]) == 1
    assert loop.attempts(item) == 4


# -- the lock and status -----------------------------------------------------------------------
def test_a_second_instance_exits_3_naming_the_holder(loop):
    loop.setup([f"hang-once {loop.marker}"])
    assert loop.command("status", str(loop.work)).returncode == 1  # never run: no status yet
    first = loop.start()
    loop.hanging()
    second = loop.run()
    assert second.returncode == 3
    assert f"another ralph-run (pid {first.pid}) holds {loop.work}" in second.stderr
    assert second.stdout == "" and "Traceback" not in second.stderr

    status = loop.command("status", str(loop.work), "--json")
    assert status.returncode == 0, status.stderr
    live = json.loads(status.stdout)
    assert live["running"] is True and live["pid"] == first.pid and live["iteration"] == 1
    assert (live["done"], live["todo"], live["skipped"]) == (0, 1, 0)
    first.terminate()
    assert first.wait(timeout=15) == 143


def test_status_reads_a_workdir_or_a_runbook(loop):
    loop.setup(["ok one", "lazy two", "ok three"], checklist={"strikes": 2})
    assert loop.run().returncode == 0
    by_workdir = loop.command("status", str(loop.work))
    by_runbook = loop.command("status", str(loop.runbook))
    assert by_workdir.returncode == by_runbook.returncode == 0
    assert by_workdir.stdout == by_runbook.stdout
    lines = by_workdir.stdout.splitlines()
    assert f"workdir:    {loop.work}" in lines
    assert "status:     not running (finished)" in lines
    assert "iterations: 4" in lines
    assert "checklist:  2 done, 0 todo, 1 skipped" in lines
    assert "deaths:     0" in lines
    as_json = json.loads(loop.command("status", str(loop.runbook), "--json").stdout)
    assert as_json["running"] is False and as_json["status"] == "finished"
    no_deaths = loop.command("deaths", str(loop.runbook)).stdout.splitlines()
    assert "no deaths recorded (4 iterations in the history)" in no_deaths
    assert (as_json["iteration"], as_json["done"], as_json["skipped"], as_json["deaths"]) == (
        4,
        2,
        1,
        0,
    )


def test_status_shows_each_step_of_the_iteration_it_is_in(loop):
    """What a probe sees in status.json: the iteration's own item and step, never the step the
    last iteration ended with (ensure_alive and verify write no status of their own)."""
    seen = loop.root / "statuses"
    loop.setup(
        ["ok one", "ok two"],
        service=True,
        health={
            "probes": [
                {
                    "name": "alive file",
                    "command": f"cat {loop.status_path} >> {seen} && echo --- >> {seen} && "
                    "test -e {{ alive }}",
                    "timeout": 1,
                }
            ]
        },
        loop={
            "steps": [
                {"ensure_alive": {"phase": "start"}},
                *yaml.safe_load(RUNBOOK)["loop"]["steps"],
                {"ensure_alive": {"phase": "end"}},
            ]
        },
    )
    done = loop.run()
    assert done.returncode == 0, done.stderr
    statuses = [json.loads(text) for text in seen.read_text().split("---\n") if text]
    shown = [(s["iteration"], s["item"], s["phase"]) for s in statuses]
    # the start of an iteration, its agent step (end: after verify, whose phase is not shown)
    assert shown == [
        (1, "ok one", None),
        (1, "ok one", "agent"),
        (2, "ok two", None),
        (2, "ok two", "agent"),
    ], shown


def test_verbose_shows_the_steps_output_line_by_line_with_secrets_masked(tmp_path):
    (tmp_path / "CHECKLIST.md").write_text("- [ ] one\n")
    runbook = tmp_path / "runbook.yaml"
    runbook.write_text(
        "vars: { token: hunter2-token }\n"
        "secrets: [token]\n"
        "loop:\n"
        "  steps:\n"
        "    - name: agent\n"
        "      shell: echo using {{ token }} and sk-abcdefghijklmnopqrstu; printf 'no newline';"
        " sed -i 's/- \\[ \\]/- [x]/' CHECKLIST.md\n"
    )
    done = subprocess.run(
        [*RALPH, str(runbook), "-v"], cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    shown = [line.split("│ ", 1)[1] for line in done.stdout.splitlines() if "│ " in line]
    assert shown == ["using **** and ****", "no newline"]
    assert "hunter2" not in done.stdout


def test_a_runbook_error_mid_run_is_saved_as_failed_and_the_next_run_resumes(loop):
    loop.setup(["ok one", "ok two"])
    data = yaml.safe_load(loop.runbook.read_text())
    data["loop"]["steps"].insert(
        1, {"name": "typo", "shell": "echo {{ item.txt }}", "when": "item.index > 0"}
    )
    loop.runbook.write_text(yaml.safe_dump(data, sort_keys=False))
    done = loop.run()
    assert done.returncode == 2, done.stderr
    assert "'txt'" in done.stderr and "loop.steps[1]" in done.stderr
    assert loop.state()["status"] == "failed" and loop.state()["iteration"] == 2
    status = loop.command("status", str(loop.work))
    assert "not running (failed)" in status.stdout

    data["loop"]["steps"].pop(1)
    loop.runbook.write_text(yaml.safe_dump(data, sort_keys=False))
    resumed = loop.run()
    assert resumed.returncode == 0, resumed.stderr
    (resume,) = of_kind(events(resumed.stdout), "resume")
    assert resume["iteration"] == 2 and loop.checklist().count("- [x]") == 2
