"""Reading another process races its end: it may exit, turn zombie or be reaped between a scan
of the process table and the next read. psutil then raises (a zombie's cmdline() raises
ZombieProcess), and a test helper that let it through failed a run (issue 31, item 21:
test_start_vllm.py's titles()). The suite's helpers and ralph-run's own readers take it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import psutil
import pytest
from support.standin import alive, cmdline_of, live_children, wait_for

from ralph_runner.probes import process as process_probe
from ralph_runner.process import kill


@pytest.fixture
def zombie() -> Iterator[psutil.Process]:
    """A child killed and not yet reaped: a zombie until the fixture waits for it."""
    child = subprocess.Popen(["sleep", "30"])
    child.kill()
    found = psutil.Process(child.pid)
    wait_for(lambda: found.status() == psutil.STATUS_ZOMBIE, 10, "a zombie")
    yield found
    child.wait(10)


def test_a_zombie_has_no_command_line_and_is_not_alive(zombie: psutil.Process) -> None:
    with pytest.raises(psutil.ZombieProcess):  # the hazard itself
        zombie.cmdline()
    assert cmdline_of(zombie) == []
    assert not alive(zombie)
    assert zombie.pid not in [p.pid for p in live_children()]


def test_a_zombie_matches_no_process_probe(zombie: psutil.Process) -> None:
    params = process_probe.Params.model_validate({"cmdline": "sleep"})
    assert not process_probe.matches(zombie, params)


def test_an_ancestor_that_ends_while_read_ends_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil's parents() raised NoSuchProcess when an ancestor ended mid-walk: the kill's
    list of whom to spare (and the process probe's) failed with it."""
    me, real_ppid = os.getpid(), psutil.Process.ppid

    def ppid(self: psutil.Process) -> int:
        if self.pid != me:  # every ancestor "ended" as it is read
            raise psutil.NoSuchProcess(self.pid)
        return real_ppid(self)

    monkeypatch.setattr(psutil.Process, "ppid", ppid)
    assert kill.lineage() == {me, os.getppid()}
    assert {me, os.getppid(), os.getpgrp()} <= kill._ourselves()
    assert process_probe.ourselves() == {me, os.getppid()}


def test_the_lineage_is_this_process_and_its_ancestors() -> None:
    assert kill.lineage() == {os.getpid(), *(p.pid for p in psutil.Process().parents())}
