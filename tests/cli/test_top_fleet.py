"""`ralph-run top -i INVENTORY` over three loopback sshd hosts, in an 80x24 tmux pane: one host
stops answering (its sshd and sessions SIGSTOPped) and the other two keep updating while its
row says "no answer"; once it goes on, so does its row."""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from support.sshd import MISSING_REASON, Sshd, running_sshd, sshd_available
from support.standin import wait_for
from top_helpers import Pane, Rewriter, iteration_of, recorded_workdir, state_of

pytestmark = [
    pytest.mark.skipif(not sshd_available(), reason=MISSING_REASON),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.timeout(150),
]
TOP = [sys.executable, "-m", "ralph_runner", "top"]
HOSTS = ["north", "south", "west"]  # west is the one that stops


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Sshd]]:
    """Three sshd servers on loopback: three hosts."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(running_sshd(tmp_path_factory.mktemp(f"sshd-{n}")))
            for n in range(3)
        ]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with recorded_workdir(tmp_path_factory.mktemp("recorded")) as workdir:
        yield workdir


@contextlib.contextmanager
def stopped(server: Sshd) -> Iterator[None]:
    """The host stops answering: its sshd and its sessions (the one of the connection ssh keeps
    open to it) get SIGSTOP; their sockets stay open. SIGCONT at the end."""
    config = str(server.log.parent / "sshd_config")
    processes = psutil.process_iter(["cmdline"])
    (listener,) = [p for p in processes if config in (p.info["cmdline"] or [])]
    # Not the commands its sessions run: the three hosts share this machine's home, and a
    # login shell stopped inside `pyenv rehash` would hold its lock against the others'.
    processes = [listener]
    for child in listener.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a session that just ended
            if child.name().startswith("sshd"):
                processes.append(child)
    for process in processes:
        with contextlib.suppress(psutil.Error):  # a session that just ended
            process.suspend()
    try:
        yield
    finally:
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.resume()


def no_answer(screen: str, host: str) -> int | None:
    """The seconds of "no answer Ns" in the host's state, or None."""
    found = re.fullmatch(r"no answer (\d+)s", state_of(screen, host) or "")
    return int(found.group(1)) if found else None


def test_a_host_that_stops_answering_holds_up_none_of_the_others(
    sshd: list[Sshd], recorded: Path, tmp_path: Path
) -> None:
    workdirs = [tmp_path / host for host in HOSTS]
    writer = Rewriter(recorded, workdirs, period=1.0)  # every loop: a new iteration each second
    writer.start()
    hosts = {}
    for host, server, workdir in zip(HOSTS, sshd, workdirs, strict=True):
        remote = {k: str(v) for k, v in server.hostvars().items() if k != "inventory_hostname"}
        hosts[host] = {**remote, "ralph_workdir": str(workdir)}
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    command = [*TOP, "-i", str(inventory)]  # each read within 5 s
    pane = Pane(f"ralph-top-{tmp_path.name}", command, tmp_path)
    try:
        pane.wait_screen(
            lambda s: all(state_of(s, h) == "running" for h in HOSTS), 30, "three hosts read"
        )
        with stopped(sshd[2]):
            screen = pane.wait_screen(lambda s: no_answer(s, "west") is not None and s, 15, "west")
            frozen, since = iteration_of(screen, "west"), no_answer(screen, "west")
            # For 8 s: a redraw every second, and north and south new at each (a redraw that
            # waited for west's read would come once in its --timeout of 5 s, and a second).
            seen: dict[str, set[int | None]] = {host: set() for host in HOSTS[:2]}
            clocks: set[str] = set()
            pause, started = threading.Event(), time.monotonic()
            while time.monotonic() - started < 8:
                later = pane.text()
                clocks.add(later.splitlines()[0])
                for host in HOSTS[:2]:
                    seen[host].add(iteration_of(later, host))
                pause.wait(0.2)  # the sampling interval of the look
            assert len(clocks) >= 5, clocks
            assert all(len(values) >= 4 for values in seen.values()), seen
            assert [state_of(later, h) for h in HOSTS[:2]] == ["running", "running"]
            assert iteration_of(later, "west") == frozen  # its last known row, as it was
            assert (no_answer(later, "west") or 0) >= (since or 0) + 5  # counting up
            assert writer.iteration[workdirs[2]] >= (frozen or 0) + 3  # its files moved on
        pane.wait_screen(
            lambda s: state_of(s, "west") == "running" and (iteration_of(s, "west") or 0) > frozen,
            30,
            "west to answer again",
        )
        with stopped(sshd[2]):  # q quits at once, not after the read that waits on west
            pane.wait_screen(lambda s: no_answer(s, "west") is not None, 15, "west stopped again")
            asked = time.monotonic()
            pane.keys("q")
            wait_for(lambda: not pane.alive(), 10, "top to quit")
            assert time.monotonic() - asked < 3  # a read's --timeout is 5 s
    finally:
        pane.close()
        writer.close()
