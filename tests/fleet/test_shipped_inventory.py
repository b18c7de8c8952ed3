"""The shipped runbook and the shipped inventory work together (issue 31, item 12).

`ralph-run runbooks/vllm.yaml -i inventory.yaml --check` in a clone said "hosts 'localhost' and
'spark-b' resolve to the same workdir": the runbook's `hosts: all` takes both of the
inventory's hosts, a run over several hosts runs one loop per host, and the two loops had the
one workdir `.`. Each host of inventory.yaml names its own loop's directory (`ralph_workdir`),
the one `ralph-run status -i` reads, and the runbook's workdir is that directory.

The command runs as a newcomer types it, in a fresh directory laid out like a clone (the
shipped runbooks/, collectors/ and inventory.yaml), with each host's workdir made as the
inventory names it: a git repository with its PLAN.md and CHECKLIST.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from support.e2e import make_workspace

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "ralph-run runbooks/vllm.yaml -i inventory.yaml --check"


def clone(tmp_path: Path) -> Path:
    """A directory like a fresh clone, each inventory host's workdir made as a loop needs it."""
    repo = tmp_path / "clone"
    repo.mkdir()
    for name in ("runbooks", "collectors", "inventory.yaml"):
        (repo / name).symlink_to(ROOT / name)
    inventory = yaml.safe_load((ROOT / "inventory.yaml").read_text(encoding="utf-8"))
    hosts = inventory["all"]["children"]["gpu_hosts"]["hosts"]
    for host, variables in hosts.items():
        workdir = (variables or {}).get("ralph_workdir")
        assert workdir, f"inventory.yaml: host {host} names no ralph_workdir"
        make_workspace(repo / Path(workdir).expanduser(), [f"an item for {host}"])
    return repo


def test_the_shipped_runbook_checks_with_the_shipped_inventory(tmp_path: Path) -> None:
    repo = clone(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-c", COMMAND], cwd=repo, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"{COMMAND}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    hosts = re.findall(r"^host: (\S+)$", done.stdout, re.MULTILINE)
    workdirs = re.findall(r"^workdir: (.+)$", done.stdout, re.MULTILINE)
    assert hosts == ["localhost", "spark-b"], done.stdout
    assert len(set(workdirs)) == 2, workdirs  # a loop of its own per host
    for host, workdir in zip(hosts, workdirs, strict=True):
        assert Path(workdir) == (repo / "work" / host).resolve(), (host, workdir)
