"""deploy/playbook.yml with the real ansible-playbook against two real sshd on 127.0.0.1: it lays
everything out, the installed ralph-run runs, the units pass `systemd-analyze verify`, it says
it started nothing where systemd is not PID 1, and a second run changes nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from support.sshd import MISSING_REASON, running_sshd, sshd_available
from support.standin import ROOT, wait_for

ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"
pytestmark = [
    pytest.mark.skipif(not sshd_available(), reason=MISSING_REASON),
    pytest.mark.skipif(not ANSIBLE_PLAYBOOK.is_file(), reason="ansible-core is not installed"),
    pytest.mark.timeout(600),
]


def playbook(inventory: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ANSIBLE_HOST_KEY_CHECKING": "False",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-local"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp"),
        "ANSIBLE_PIPELINING": "True",  # one ssh round-trip a task: 190 s for the test, not 243 s
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    command = [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), str(ROOT / "deploy" / "playbook.yml")]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=500)


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP: host -> {ok, changed, failed, ...}."""
    found = {}
    for host, counts in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, re.MULTILINE):
        found[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
    return found


def close_masters(control_dir: Path) -> None:
    """Ansible's ssh control masters (ControlPersist) ended: they outlived the test by minutes."""
    for socket in control_dir.glob("*") if control_dir.is_dir() else ():
        subprocess.run(
            ["ssh", "-o", f"ControlPath={socket}", "-O", "exit", "localhost"],
            capture_output=True,
            timeout=10,
        )


def agent_repo(workdir: Path) -> None:
    """What the operator puts in the workdir the role made: the agent's git repository with its
    CHECKLIST.md (--check refuses a workdir without them, as the run does)."""
    (workdir / "CHECKLIST.md").write_text("- [ ] an item\n")
    subprocess.run(["git", "init", "-q", str(workdir)], check=True)


def test_the_playbook_installs_every_loop_and_a_second_run_changes_nothing(tmp_path: Path):
    try:
        _installs_and_changes_nothing(tmp_path)
    finally:
        close_masters(tmp_path / "cp")

    def masters() -> list[list[str]]:
        found = [p.info["cmdline"] or [] for p in psutil.process_iter(["cmdline"])]
        return [line for line in found if str(tmp_path) in " ".join(line)]

    wait_for(lambda: not masters(), 10, "ssh's control masters to exit")


def _installs_and_changes_nothing(tmp_path: Path) -> None:
    for name in ("sshd-a", "sshd-b"):
        (tmp_path / name).mkdir()
    with (
        running_sshd(tmp_path / "sshd-a") as first,
        running_sshd(tmp_path / "sshd-b") as second,
    ):
        hosts = {}
        for name, server in (("gpu-a", first), ("gpu-b", second)):
            home = tmp_path / name
            hosts[name] = {
                **{k: str(v) for k, v in server.hostvars().items() if k != "inventory_hostname"},
                "ansible_python_interpreter": str(BASE_PYTHON),
                "ralph_python": str(BASE_PYTHON),
                "ralph_home": str(home / "ralph-run"),
                "ralph_unit_dir": str(home / "units"),
                "ralph_loop_vars": {"container": f"vllm-{name}"},
                "ralph_loops": [
                    {
                        "name": "main",
                        "runbook": "runbooks/vllm.yaml",
                        "workdir": str(home / "repo"),
                        "extra_vars": {"model": "qwen3-coder"},
                    }
                ],
            }
        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({"all": {"children": {"gpu_hosts": {"hosts": hosts}}}}))

        first_run = playbook(inventory, tmp_path)
        assert first_run.returncode == 0, first_run.stdout + first_run.stderr
        counts = recap(first_run.stdout)
        assert set(counts) >= {"gpu-a", "gpu-b"} and counts["gpu-a"]["changed"] > 0
        assert "did not start ralph-run-main" in first_run.stdout

        for name in hosts:
            home = tmp_path / name / "ralph-run"
            assert (home / "runbooks" / "vllm.yaml").is_file()
            assert (home / "collectors" / "docker.yaml").is_file()
            loop_vars = json.loads((home / "loops" / "main.json").read_text())
            assert loop_vars == {"container": f"vllm-{name}", "model": "qwen3-coder"}
            unit = tmp_path / name / "units" / "ralph-run-main.service"
            text = unit.read_text()
            assert "KillMode=control-group" in text and "Restart=on-failure" in text
            assert "RestartPreventExitStatus=2 4 6" in text and "SuccessExitStatus=5" in text
            exec_start = re.search(r"^ExecStart=(.*)$", text, re.MULTILINE)[1].split()
            assert exec_start[0] == str(home / "venv" / "bin" / "ralph-run")
            agent_repo(tmp_path / name / "repo")
            check = subprocess.run(
                [*exec_start, "--check"],
                cwd=tmp_path / name / "repo",
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert check.returncode == 0, check.stderr  # the installed ralph-run reads its loop
            assert f"vllm-{name}" in check.stdout
            # The wheel carries the shipped runbooks and collector sets (setup.py copies them
            # into the package): `ralph-run demo` and `use:` find them in the installed package.
            python = home / "venv" / "bin" / "python"
            where = "from ralph_runner.runbook import loader; print(loader.shipped('{0}'))"
            for folder, file in (("runbooks", "demo.yaml"), ("collectors", "docker.yaml")):
                found = subprocess.run(  # -I: not the checkout's package from the cwd
                    [str(python), "-I", "-c", where.format(folder)], capture_output=True, text=True
                )
                shipped = Path(found.stdout.strip())
                assert shipped.is_relative_to(home / "venv"), found.stdout + found.stderr
                assert (shipped / file).is_file(), shipped
            if shutil.which("systemd-analyze"):
                verify = subprocess.run(
                    ["systemd-analyze", "verify", str(unit)],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert verify.returncode == 0, verify.stderr

        again = playbook(inventory, tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        assert {host: c["changed"] for host, c in recap(again.stdout).items()} == {
            "gpu-a": 0,
            "gpu-b": 0,
        }, again.stdout
