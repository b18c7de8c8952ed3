"""Iteration numbers go on across runs in one workdir (issue 31, item 8): after a stopped or
finished run the next one continues from the last number, so the history, `top` and a death's
"iter N" name one iteration each; max_iterations still counts each run's own iterations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(60)

AGENT = "sed -i '0,/^- \\[ \\] /s//- [x] /' CHECKLIST.md && git commit -qam {{ item.text }}"


def git(work: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=work, check=True, capture_output=True)


def run(root: Path) -> tuple[int, list[dict]]:
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "runbook.yaml", "--json"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=45,
    )
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def numbers(events: list[dict]) -> list[int]:
    return [e["iteration"] for e in events if e["event"] == "iteration"]


def summary(events: list[dict]) -> dict:
    return next(e for e in events if e["event"] == "summary")


def test_numbers_continue_after_a_stopped_and_a_finished_run(tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "CHECKLIST.md").write_text("- [ ] a\n- [ ] b\n- [ ] c\n")
    git(work, "init", "-q", "-b", "main")
    git(work, "config", "user.email", "t@example.com")
    git(work, "config", "user.name", "t")
    git(work, "add", "-A")
    git(work, "commit", "-qm", "init")
    runbook = {
        "name": "numbers",
        "workdir": "work",
        "prompt": "commit: {{ item.text }}",
        "loop": {
            "max_iterations": 2,
            "steps": [
                {"name": "agent", "shell": AGENT, "timeout": 20},
                {"verify": {"checked": True, "committed": True}},
            ],
        },
    }
    (tmp_path / "runbook.yaml").write_text(yaml.safe_dump(runbook, sort_keys=False))

    code, events = run(tmp_path)  # stops at max_iterations with c left
    assert code == 5 and numbers(events) == [1, 2], events
    code, events = run(tmp_path)  # starts over: finishes c
    assert code == 0 and numbers(events) == [3], events
    assert summary(events)["iterations"] == 1
    with (work / "CHECKLIST.md").open("a") as f:
        f.write("- [ ] d\n- [ ] e\n- [ ] f\n")
    git(work, "commit", "-qam", "more")
    code, events = run(tmp_path)  # after a finished run: numbers go on, its own max_iterations
    assert code == 5 and numbers(events) == [4, 5], events
    assert summary(events)["iterations"] == 2

    history = (work / ".ralph" / "iterations.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in history] == [1, 2, 3, 4, 5]
    status = json.loads((work / ".ralph" / "status.json").read_text())
    assert status["iteration"] == 5
