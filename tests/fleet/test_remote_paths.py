"""A host's `ralph_workdir` is one word of the remote shell line (issue 29, finding 8): a `~/`
workdir was spliced unquoted into the lines of `status -i`, `pause -i` and `resume -i`, so an
inventory's `ralph_workdir: "~/x$(touch /tmp/p)"` ran the command on the host, and a path with
a space broke. Over a real sshd on 127.0.0.1 (the injection), and through the local connection
with HOME set to a test directory (a `~/` path with a space, read, paused and resumed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.sshd import MISSING_REASON, running_sshd, sshd_available
from support.standin import python_env

pytestmark = pytest.mark.timeout(90)
RALPH = [sys.executable, "-m", "ralph_runner"]


def _ralph(*args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = python_env(**({"HOME": str(home)} if home else {}))
    return subprocess.run([*RALPH, *args], capture_output=True, text=True, timeout=60, env=env)


def _inventory(path: Path, hosts: dict[str, dict[str, object]]) -> str:
    path.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    return str(path)


@pytest.mark.skipif(not sshd_available(), reason=MISSING_REASON)
def test_a_workdir_that_holds_a_command_substitution_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    workdir = f"~/x$(touch {marker})"
    (tmp_path / "sshd").mkdir()
    with running_sshd(tmp_path / "sshd") as sshd:
        remote = {k: v for k, v in sshd.hostvars().items() if k != "inventory_hostname"}
        inventory = _inventory(
            tmp_path / "inventory.yaml", {"h": {**remote, "ralph_workdir": workdir}}
        )
        said = {
            "status": _ralph("status", "-i", inventory, "--json"),
            "pause": _ralph("pause", "-i", inventory, "--json"),
            "resume": _ralph("resume", "-i", inventory, "--json"),
        }
    assert not marker.exists(), {k: v.stdout + v.stderr for k, v in said.items()}
    status = json.loads(said["status"].stdout)[0]
    assert status["reachable"] is True and "no status" in status["error"], status
    for action in ("pause", "resume"):
        row = json.loads(said[action].stdout)[0]
        assert "no such workdir" in row["error"], row  # the path, quoted, does not exist


def test_a_home_workdir_with_a_space_is_read_paused_and_resumed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    state = home / "my loop" / ".ralph"
    state.mkdir(parents=True)
    status = {"status": "finished", "running": False, "pid": 0, "iteration": 7, "deaths": 2}
    (state / "status.json").write_text(json.dumps(status))
    local = {"ansible_connection": "local", "ralph_workdir": "~/my loop"}
    inventory = _inventory(tmp_path / "inventory.yaml", {"h": local})

    read = _ralph("status", "-i", inventory, "--json", home=home)
    row = json.loads(read.stdout)[0]
    assert (row.get("status"), row.get("iteration"), row.get("deaths")) == ("finished", 7, 2), row

    paused = _ralph("pause", "-i", inventory, "--json", home=home)
    assert paused.returncode == 0, paused.stdout + paused.stderr
    assert (state / "pause").exists()
    resumed = _ralph("resume", "-i", inventory, "--json", home=home)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not (state / "pause").exists()
    assert not (home / "my").exists() and os.listdir(home) == ["my loop"]
