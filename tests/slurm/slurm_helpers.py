"""The slurm tier's helpers: the one-node Slurm ci/install-slurm.sh started (or why there is
none), workspaces whose loops run as real Slurm jobs against the stand-in server, and
`ralph-run slurm` driven as an operator would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from support.e2e import make_workspace, runbook
from support.standin import ROOT, START_SCRIPT, free_port, python_env, wait_for

CACHE = ROOT / ".cache"
SLURM_CONF = CACHE / "slurm" / "slurm.conf"
UNAVAILABLE = CACHE / "slurm.unavailable"
STANDIN_PIDS = 'kill -TERM -- "-$(cat .standin/server.pid)"'
# a node that cannot bring the server back: after its first start, the first attempt of the
# job (SLURM_RESTART_COUNT unset) refuses to start it again; a requeued attempt can (the marker
# is not in .standin/, which the start script makes anew)
CANNOT_RECOVER = (
    'if [ -e server-started-once ] && [ "${SLURM_RESTART_COUNT:-0}" = 0 ];'
    " then echo 'this node cannot start the server' >&2; exit 1; fi; touch server-started-once; "
)


NOT_THE_AGENTS = (".standin/", "logs/", "server-gpus", "server-started-once", "teardown.log")


def tier_missing() -> str | None:
    """Why the tier cannot run here (the install's own line), or None."""
    if UNAVAILABLE.exists():
        return f"slurm unavailable here: {UNAVAILABLE.read_text().strip()}"
    if not SLURM_CONF.exists():
        return "slurm not started: run ci/install-slurm.sh start"
    return None


def slurm_env() -> dict[str, str]:
    return python_env(SLURM_CONF=str(SLURM_CONF))


def slurm(*argv: str) -> str:
    """A Slurm command (squeue, scontrol, scancel) against the tier's cluster: its stdout."""
    done = subprocess.run(argv, env=slurm_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def ralph_slurm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`ralph-run slurm ARGS` from this checkout."""
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "slurm", *args],
        env=slurm_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


@dataclass
class Loop:
    """One loop's workdir (a git workspace) and the facts of its job."""

    name: str
    workdir: Path
    items: list[str]
    vars: dict[str, Any] = field(default_factory=dict)

    def checklist(self) -> str:
        return (self.workdir / "CHECKLIST.md").read_text(encoding="utf-8")

    def commits(self) -> list[str]:
        """The workspace's commit subjects, oldest first (the first is the plan's)."""
        done = subprocess.run(
            ["git", "-C", str(self.workdir), "log", "--reverse", "--format=%s"],
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.splitlines()

    def commit_times(self) -> list[tuple[str, float]]:
        """The item commits (subject, unix time), oldest first."""
        done = subprocess.run(
            ["git", "-C", str(self.workdir), "log", "--reverse", "--format=%ct %s"],
            capture_output=True,
            text=True,
            check=True,
        )
        lines = [line.split(" ", 1) for line in done.stdout.splitlines()[1:]]
        return [(subject, float(when)) for when, subject in lines]

    def attempts(self) -> list[dict[str, Any]]:
        path = self.workdir / ".ralph" / "slurm" / "attempts.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def events(self, event: str) -> list[dict[str, Any]]:
        return [a for a in self.attempts() if a["event"] == event]

    def status(self) -> dict[str, Any]:
        try:
            return json.loads((self.workdir / ".ralph" / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def death_records(self) -> list[dict[str, Any]]:
        path = self.workdir / "logs" / "deaths.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [r for r in map(json.loads, filter(None, lines)) if r["event"] == "death"]

    def job_id(self) -> str:
        record = self.workdir / ".ralph" / "slurm" / "submission.json"
        return str(json.loads(record.read_text())["job_id"])


def fleet(
    root: Path,
    loops: dict[str, list[str]],
    *,
    gpus: int = 1,
    agent_sleep: str = "0.1",
    recovery_prefix: str = "",
    after_agent: str = "",
    max_requeues: int = 2,
    loop_vars: dict[str, dict[str, Any]] | None = None,
) -> tuple[Path, list[Loop]]:
    """A runbook, one workspace per loop, and the jobs file that submits them: each loop's
    stand-in server is started by the runbook inside its job, on a port of its own; its
    teardown stops it and says so in `teardown.log`. `loop_vars`: a loop's own variables (a
    default for each must be in the runbook's: `runbook_vars`)."""
    defaults = {
        key: value for values in (loop_vars or {}).values() for key, value in values.items()
    }
    book = runbook(
        agent_sleep=agent_sleep,
        after_agent=after_agent,
        healthy_within=5,
        variables=dict.fromkeys(defaults, ""),
    )
    book["recovery"]["steps"][0]["shell"] = recovery_prefix + book["recovery"]["steps"][0]["shell"]
    book["recovery"]["steps"][0]["shell"] += " && printenv CUDA_VISIBLE_DEVICES > server-gpus"
    book["recovery"]["attempts"] = 1
    book["teardown"] = [
        {"name": "stop the server", "shell": STANDIN_PIDS, "ignore_errors": True},
        {"name": "say so", "shell": "echo torn down >> teardown.log"},
    ]
    runbook_path = root / "runbook.yaml"
    runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
    built = []
    for name, items in loops.items():
        workdir = make_workspace(root / name, items)
        # what the server and the tier's steps write there is not the agent's work (its
        # `git add -A` would commit it, and the loop's verify see it change afterwards)
        (workdir / ".git" / "info" / "exclude").write_text("\n".join(NOT_THE_AGENTS) + "\n")
        facts = {"port": free_port(), "standin_start": str(START_SCRIPT), "python": sys.executable}
        built.append(Loop(name, workdir, items, {**facts, **(loop_vars or {}).get(name, {})}))
    jobs = {
        "runbook": "runbook.yaml",
        "defaults": {"gpus": gpus, "time": "10:00", "max_requeues": max_requeues},
        "jobs": [{"name": loop.name, "workdir": loop.name, "vars": loop.vars} for loop in built],
    }
    jobs_file = root / "jobs.yaml"
    jobs_file.write_text(yaml.safe_dump(jobs, sort_keys=False))
    return jobs_file, built


def job_state(job_id: str) -> str:
    """The job's state as Slurm says it now (PENDING, RUNNING, COMPLETED, ...)."""
    text = slurm("scontrol", "show", "job", "-o", job_id)
    return text.split("JobState=", 1)[1].split()[0]


def wait_ended(loops: list[Loop], timeout: float = 60) -> None:
    """Until every loop's job has ended for good: its last attempt line is an end, not a
    requeue (a requeued job is pending, then starts again)."""

    def ended() -> bool:
        return all(
            loop.attempts()
            and loop.attempts()[-1]["event"] in ("end", "cancelled", "time-limit")
            and job_state(loop.job_id()) in ("COMPLETED", "FAILED", "CANCELLED")
            for loop in loops
        )

    wait_for(ended, timeout, "every job ended")


def all_done_once(loop: Loop) -> None:
    """Every item ticked, each by exactly one commit: none lost, none done twice."""
    assert loop.checklist().count("- [x]") == len(loop.items), loop.checklist()
    ticked = loop.commits()[1:]
    assert len(ticked) == len(loop.items), ticked
    for item in loop.items:
        assert ticked.count(f"done: {item}") == 1, (item, ticked)
    output = "".join(p.read_text() for p in (loop.workdir / ".ralph" / "slurm").glob("job-*.out"))
    assert not re.search(r"strike \d+/\d+", output), output  # each item passed its verify at once
