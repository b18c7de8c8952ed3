"""`ralph-run status -i INVENTORY`: each host's loop read over its own connection (local, real
sshd on 127.0.0.1), all at once; a host that cannot be reached says so within the timeout."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.e2e import Scenario
from support.sshd import MISSING_REASON, running_sshd, sshd_available

RALPH = [sys.executable, "-m", "ralph_runner"]
pytestmark = [
    pytest.mark.skipif(not sshd_available(), reason=MISSING_REASON),
    pytest.mark.timeout(90),
]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture
def finished_loop(tmp_path: Path) -> Iterator[Path]:
    """A workspace whose loop really ran: two items, one death, recovered."""
    scenario = Scenario(tmp_path / "loop")
    try:
        scenario.prepare(["add the road", "add the car"], agent_sleep="0.3")
        run = scenario.start()
        run.wait_agent(1)
        scenario.standin.trigger(die=True)
        assert run.wait() == 0, run.stderr
        yield scenario.workspace
    finally:
        scenario.close()


class Silent:
    """A TCP port that accepts connections and never says a word (a host that hangs), and when
    it accepted each (time.monotonic())."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.accepted_at: list[float] = []


@pytest.fixture
def silent() -> Iterator[Silent]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()
    port = Silent(server.getsockname()[1])

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
                port.accepted_at.append(time.monotonic())
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield port
    stop.set()
    thread.join()
    for connection in accepted:
        connection.close()
    server.close()


def test_every_host_is_read_over_its_connection_and_a_silent_one_is_unreachable(
    tmp_path: Path, sshd, finished_loop: Path, silent: Silent
) -> None:
    remote = {k: str(v) for k, v in sshd.hostvars().items() if k != "inventory_hostname"}
    quiet = {**remote, "ansible_port": str(silent.port), "ralph_workdir": "/srv"}
    hosts = {
        "here": {"ansible_connection": "local", "ralph_workdir": str(finished_loop)},
        "over-ssh": {**remote, "ralph_workdir": str(finished_loop)},
        **{f"silent-{n}": quiet for n in (1, 2, 3)},  # each waits out its 3 s timeout
        "no-loop": {"ansible_connection": "local", "ralph_workdir": str(tmp_path)},
    }
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))

    started = time.monotonic()
    result = subprocess.run(
        [*RALPH, "status", "-i", str(inventory), "--timeout", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr  # some host could not be read
    rows = {row["host"]: row for row in json.loads(result.stdout)}
    for host in ("here", "over-ssh"):
        row = rows[host]
        assert (row["reachable"], row["running"], row["status"]) == (True, False, "finished")
        assert (row["done"], row["todo"], row["deaths"]) == (2, 0, 1)
    for n in (1, 2, 3):
        assert rows[f"silent-{n}"]["reachable"] is False
        assert "within 3 s" in rows[f"silent-{n}"]["error"]
    assert rows["no-loop"]["reachable"] is True and "no status" in rows["no-loop"]["error"]
    # All at once: the three silent hosts were connected to within one timeout of each other
    # (one at a time, each waits 3 s before the next is tried), and the whole read took less
    # than the 9 s they alone take one by one.
    first_three = silent.accepted_at[:3]
    assert len(first_three) == 3 and first_three[-1] - first_three[0] < 3, silent.accepted_at
    assert elapsed < 3 * 3, elapsed

    text = subprocess.run(
        [*RALPH, "status", "-i", str(inventory), "--limit", "here:over-ssh"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split()[:3] == ["host", "state", "iter"]
    assert [line.split()[0] for line in lines[1:]] == ["here", "over-ssh"]
    assert all(" finished " in line for line in lines[1:])
