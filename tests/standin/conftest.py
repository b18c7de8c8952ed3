"""The stand-in tests' servers: a state directory whose servers are all gone when the test
ends (`standin`), and one started by the start script (`server`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.standin import StandIn


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    """A stand-in state directory; every server it ran is gone when the test ends."""
    with StandIn(tmp_path / "vllm") as server:
        yield server
    assert server.processes() == []


@pytest.fixture
def server(standin: StandIn) -> StandIn:
    """A stand-in started by the start script."""
    standin.start()
    return standin
