"""Every `ralph-run RUNBOOK ...` command line the README, the docs and the runbooks' comments
show is accepted as written (issue 21: a documented `-e` the CLI refused stopped a newcomer
cold). Each runs with `--check` added (validate and render the whole plan, run nothing) in a
fresh repository, as a reader would type it from there; `$RALPH` is the clone's path.
The real-engine tier runs vllm-local.yaml's CPU command itself (tests/real/test_real_newcomer.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.e2e import make_workspace

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("runbooks/*.yaml")),
]
# A run command: env assignments, then ralph-run and a runbook path (inside backticks or not).
RUN = re.compile(
    r"(?:^|[\s`(])((?:[A-Z_]+=\S+\s+)*ralph-run\s+(?:\$RALPH/)?runbooks/[\w./-]+\.yaml\b.*)"
)


def commands() -> list[tuple[str, str]]:
    """(where, command) for each concrete run command: comment marks stripped, backslash
    continuations joined, what follows a closing backtick or a comment left out; placeholders
    (RUNBOOK, my-loop.yaml) do not match."""
    found = []
    for source in SOURCES:
        lines = source.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            text = re.sub(r"^\s*#\s*", "", line) if source.suffix == ".yaml" else line
            for match in RUN.finditer(text.strip()):
                command, follow = match.group(1), number
                while command.rstrip().endswith("\\") and follow + 1 < len(lines):
                    follow += 1
                    command = command.rstrip()[:-1] + " " + re.sub(r"^\s*#?\s*", "", lines[follow])
                command = re.split(r"`|\s#\s|\)$", command)[0].strip()
                found.append((f"{source.relative_to(ROOT)}:{number + 1}", command))
    return found


def host_workdirs() -> list[str]:
    """The `ralph_workdir` of every host of the shipped inventory.yaml."""
    found: list[str] = []

    def walk(group: dict) -> None:
        for variables in (group.get("hosts") or {}).values():
            if (variables or {}).get("ralph_workdir"):
                found.append(variables["ralph_workdir"])
        for child in (group.get("children") or {}).values():
            walk(child or {})

    for group in yaml.safe_load((ROOT / "inventory.yaml").read_text(encoding="utf-8")).values():
        walk(group or {})
    return sorted(set(found))


def test_the_docs_show_run_commands() -> None:
    wheres = {where.split(":")[0] for where, _ in commands()}
    assert "runbooks/vllm-local.yaml" in wheres and "runbooks/vllm.yaml" in wheres, wheres


@pytest.mark.parametrize(("where", "command"), commands(), ids=lambda v: v)
def test_a_documented_command_is_accepted_as_written(
    where: str, command: str, tmp_path: Path
) -> None:
    repo = make_workspace(tmp_path / "repo", ["an item"])
    for name in ("runbooks", "collectors", "inventory.yaml"):  # as in a clone: runbooks/...
        (repo / name).symlink_to(ROOT / name)
    if "inventory.yaml" in command:  # each host's loop lives in its own workdir (docs: fleet),
        for workdir in host_workdirs():  # a git repository with its checklist, as --check needs
            make_workspace(repo / workdir, ["an item"])
    checked = command if "--check" in command else f"{command} --check"
    env = {
        **os.environ,
        "RALPH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", "-c", checked], cwd=repo, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"{where}: {command}\n{done.stderr[-2000:]}"
