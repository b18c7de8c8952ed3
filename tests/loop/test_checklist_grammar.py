"""The checklist's grammar as the real loop sees it (issue 31, item 7): every GitHub task-list
form is worked on and ticked, nothing in a code fence is, and lines that look like items but
are not are named in one warning at the start of the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(60)

CHECKLIST = (
    "# Checklist\n"  # 1
    "\n"  # 2
    "- [ ] dash\n"  # 3
    "* [ ] star\n"  # 4
    "+ [x] plus, done\n"  # 5
    "1. [ ] ordered\n"  # 6
    "  2) [ ] nested ordered\n"  # 7
    "```markdown\n"  # 8
    "- [ ] an example in a fence\n"  # 9
    "```\n"  # 10
    "-[ ] glued\n"  # 11
    "- [?] unknown mark\n"  # 12
    "- [ ]\n"  # 13
)

# The stand-in agent's own tick (ralph_runner/standin/agent.py), then a commit.
AGENT = (
    "echo {{ item.text | quote }} >> ../worked.log && "
    f"{sys.executable} -c 'from pathlib import Path; from ralph_runner.standin.agent import "
    'tick; tick(Path("CHECKLIST.md"))\' && git commit -qam {{ item.text | quote }}'
)


def git(work: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=work, check=True, capture_output=True)


def test_every_task_list_form_is_ticked_and_near_misses_are_warned_once(tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "CHECKLIST.md").write_text(CHECKLIST)
    git(work, "init", "-q", "-b", "main")
    git(work, "-c", "user.email=t@example.com", "-c", "user.name=t", "add", "-A")
    git(work, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "init")
    git(work, "config", "user.email", "t@example.com")
    git(work, "config", "user.name", "t")
    runbook = {
        "name": "grammar",
        "workdir": "work",
        "checklist": {"path": "CHECKLIST.md", "strikes": 1},
        "prompt": "commit: {{ item.text }}",
        "loop": {
            "max_iterations": 10,
            "steps": [
                {"name": "agent", "shell": AGENT, "timeout": 20},
                {"verify": {"checked": True, "committed": True}},
            ],
        },
    }
    (tmp_path / "runbook.yaml").write_text(yaml.safe_dump(runbook, sort_keys=False))
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "runbook.yaml", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    assert len(warnings) == 1, warnings
    assert "lines 11, 12, 13 look like an item" in warnings[0]
    worked = (tmp_path / "worked.log").read_text().splitlines()
    assert worked == ["dash", "star", "ordered", "nested ordered"]
    assert (work / "CHECKLIST.md").read_text() == (
        CHECKLIST.replace("- [ ] dash", "- [x] dash")
        .replace("* [ ] star", "* [x] star")
        .replace("1. [ ] ordered", "1. [x] ordered")
        .replace("2) [ ] nested", "2) [x] nested")
    )
