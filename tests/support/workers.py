"""The workers' tests' workspace (tests/loop/test_workers.py, test_governor.py): a checklist,
a shared file, and a runbook whose agent step is the stand-in agent (one streamed call to the
stand-in, nothing ticked: `--checklist /dev/null`) followed by WORK, a shell script that does the
item's work by its first word, ticks the item in hand (not the first one) and commits, as a real
agent in a worktree does."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from support.e2e import AGENT_STEP, RalphRun, Scenario, make_workspace, runbook

WORK = r"""#!/bin/bash
# $1: the item's text. Its first word says what to do.
item=$1 word=${1%% *}
case "$word" in
  ok) echo "$item" > "$(echo "$item" | tr ' ' _).txt" ;;
  slow)  # done once $SLOW_GATE exists (a test's signal), at once without one
    while [ -n "${SLOW_GATE:-}" ] && [ ! -e "$SLOW_GATE" ]; do sleep 0.05; done
    echo "$item" > "$(echo "$item" | tr ' ' _).txt" ;;
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
    workers: int | str = 4,
    sleep: str = "0.3",
    loop: dict[str, Any] | None = None,
    standin: dict[str, str] | None = None,
    watch: float = 0.3,
    engine_probe: bool = False,
    **changes: dict[str, Any],
) -> Scenario:
    """The workspace (with shared.txt), a runbook with `workers` whose agent is WORK; `loop`:
    more of its loop section; `standin`: the stand-in's start settings (MAX_NUM_SEQS...);
    `watch`, `engine_probe`: as support.e2e.runbook's; `changes`: top-level runbook sections
    (checklist, limits)."""
    work = scenario.root / "work.sh"
    work.write_text(WORK)
    work.chmod(0o755)
    make_workspace(scenario.workspace, items)
    (scenario.workspace / "shared.txt").write_text("base\n")
    git(scenario.workspace, "add", "shared.txt")
    git(scenario.workspace, "commit", "-qm", "shared")
    data = runbook(watch=watch, max_iterations=0, engine_probe=engine_probe)
    agent = (
        "{{ python }} -m ralph_runner.standin.agent --url {{ agent_base_url }} --model {{ model }}"
        f" --timeout 5 --checklist /dev/null --no-commit --sleep {{{{ {sleep} }}}}"
        " -- {{ item.text | quote }}"
        f" && {work} {{{{ item.text | quote }}}}"
    )
    data["loop"]["workers"] = workers
    data["loop"].update(loop or {})
    data["loop"]["steps"][1]["shell"] = agent
    data.update(changes)
    scenario.runbook_path.write_text(yaml.safe_dump(data, sort_keys=False))
    scenario.standin.start(**{"HEALTH_TIMEOUT": "1", **(standin or {})})
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
