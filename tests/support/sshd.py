"""A real OpenSSH server on 127.0.0.1 for tests: throwaway keys, config and port in a tmp dir.

Runs `/usr/sbin/sshd -D -e` as the current user. As root, sshd also needs its privilege
separation directory /run/sshd, which a service manager would normally create; we create it.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
MISSING_REASON = f"{SSHD} is not installed (apt-get install -y openssh-server)"


def sshd_available() -> bool:
    return SSHD.is_file() and all(shutil.which(tool) for tool in ("ssh", "ssh-keygen"))


@dataclass(frozen=True)
class Sshd:
    """A running sshd and everything a client needs to log in to it."""

    port: int
    user: str
    client_key: Path
    known_hosts: Path
    log: Path

    def hostvars(self, **more: object) -> dict[str, object]:
        """Ansible host variables that reach this server."""
        return {
            "inventory_hostname": "sshd-under-test",
            "ansible_connection": "ssh",
            "ansible_host": "127.0.0.1",
            "ansible_port": self.port,
            "ansible_user": self.user,
            "ansible_ssh_private_key_file": str(self.client_key),
            # -F /dev/null: the test must not depend on the ~/.ssh/config of whoever runs it
            "ansible_ssh_common_args": f"-F /dev/null -o UserKnownHostsFile={self.known_hosts}",
            "ansible_ssh_extra_args": "-o IdentitiesOnly=yes",
            **more,
        }


@contextlib.contextmanager
def running_sshd(directory: Path, *, ready_within: float = 10.0) -> Iterator[Sshd]:
    """Start sshd on a free loopback port; stop it (and wait for it) on exit."""
    host_key, client_key = directory / "host_key", directory / "client_key"
    for key in (host_key, client_key):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
            check=True,
            capture_output=True,
        )
    authorized_keys = directory / "authorized_keys"
    authorized_keys.write_bytes(client_key.with_suffix(".pub").read_bytes())
    port = _free_port()
    config = directory / "sshd_config"
    config.write_text(
        f"Port {port}\n"
        "ListenAddress 127.0.0.1\n"
        f"HostKey {host_key}\n"
        f"PidFile {directory / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {authorized_keys}\n"
        "StrictModes no\n"
        "UsePAM no\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log = directory / "sshd.log"
    with log.open("wb") as log_file:
        server = subprocess.Popen(
            [str(SSHD), "-D", "-e", "-f", str(config)], stdout=log_file, stderr=log_file
        )
    try:
        _wait_for_banner(port, server, log, ready_within)
        yield Sshd(port, getpass.getuser(), client_key, directory / "known_hosts", log)
    finally:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_banner(port: int, server: subprocess.Popen, log: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"sshd exited with {server.returncode}: {log.read_text()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as s:
            if s.recv(64).startswith(b"SSH-"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"sshd did not answer on port {port} within {within} s: {log.read_text()}")
