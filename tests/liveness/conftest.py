"""Fixtures of the probe tests (test_probes.py, test_command_process_probes.py): one shared
HTTP client, a local connection, a process with a name of its own, and a check that no test
leaves a child process running."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.standin import live_children, unique_token, wait_for

from ralph_runner.process.connection import Connection, for_host


@pytest.fixture
def nothing_left_behind() -> Iterator[None]:
    """No test leaves a child process of this one running (`usefixtures` in a module)."""
    yield
    wait_for(lambda: not live_children(), 5, "the test's child processes to end")


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as shared:
        yield shared


@pytest.fixture
def connection() -> Connection:
    return for_host({})


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, str]]:
    """A real process with a name of its own (a copy of sleep), a pidfile, and that name: one
    no other test's process has (pytest-xdist runs three tests at a time, and a probe by a
    shared name found another test's sleeper). 14 characters: the kernel keeps 15 of a name."""
    name = f"rr{unique_token()}"
    program = tmp_path / name
    shutil.copy(shutil.which("sleep"), program)
    child = subprocess.Popen([str(program), "30"])
    pidfile = tmp_path / "server.pid"
    pidfile.write_text(f"{child.pid}\n")
    yield child, pidfile, name
    child.kill()
    child.wait(5)
