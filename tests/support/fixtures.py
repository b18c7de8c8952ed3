"""The fixtures shared by the test folders; a folder's own stay in its conftest.py. Loaded as a
pytest plugin by tests/conftest.py's `pytest_plugins`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.e2e import RalphRun, Scenario


@pytest.fixture(autouse=True)
def no_ralph_run_left() -> Iterator[None]:
    """A test that fails half-way leaves no ralph-run behind. One that was left went on
    recovering the real engine after the session's teardown had stopped it, and left a vLLM
    server that nothing stopped."""
    yield
    while RalphRun.started:
        RalphRun.started.pop().kill()


@pytest.fixture
def scenario(tmp_path: Path) -> Iterator[Scenario]:
    """A workspace, a stand-in server and a runbook under tmp_path; whatever still runs at the
    end (a failed test's ralph-run, its server) is killed."""
    built = Scenario(tmp_path)
    try:
        yield built
    finally:
        built.close()
