"""First contact with an ssh host is said (issue 29, finding 14): with
`StrictHostKeyChecking=accept-new` and `LogLevel=ERROR`, ssh added a host it never met to
known_hosts without a word. Now the first command to it prints a warning that names the host
and the fingerprint of the key it was trusted with, once; a known host gets no warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.sshd import MISSING_REASON, running_sshd, sshd_available
from support.standin import python_env

pytestmark = [
    pytest.mark.skipif(not sshd_available(), reason=MISSING_REASON),
    pytest.mark.timeout(90),
]


def test_the_first_contact_names_the_host_and_its_key_once(tmp_path: Path) -> None:
    (tmp_path / "sshd").mkdir()
    with running_sshd(tmp_path / "sshd") as sshd:
        remote = {k: v for k, v in sshd.hostvars().items() if k != "inventory_hostname"}
        hosts = {"h": {**remote, "ralph_workdir": str(tmp_path)}}
        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
        status = [sys.executable, "-m", "ralph_runner", "status", "-i", str(inventory), "--json"]
        assert not sshd.known_hosts.exists()
        first, second = (
            subprocess.run(status, capture_output=True, text=True, timeout=60, env=python_env())
            for _ in range(2)
        )
    key = subprocess.run(
        ["ssh-keygen", "-l", "-f", str(tmp_path / "sshd" / "host_key.pub")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[1]  # SHA256:...
    assert key.startswith("SHA256:")
    host = f"[127.0.0.1]:{sshd.port}"
    warning = [line for line in first.stderr.splitlines() if "first contact" in line]
    assert len(warning) == 1, first.stderr
    assert host in warning[0] and f"{key} (ED25519)" in warning[0], warning
    assert str(sshd.known_hosts) in warning[0]
    assert "first contact" not in second.stderr, second.stderr  # known now: nothing to say
    assert sshd.known_hosts.exists()
