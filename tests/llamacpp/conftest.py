"""The llama.cpp tier: real `llama-server` (built from llama-cpp-python's source package by
ci/install-llamacpp.sh) serving tiny random GGUF models, driven by the real ralph-run through
runbooks/llama-cpp.yaml. Without the install each test is skipped with its one-line reason,
never passed. One server (started through the runbook's own start script) is shared by the
loops; it is killed at the end of the session and every server it ever had is checked gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from llamacpp_helpers import Server, tier_missing
from support.standin import free_port


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = tier_missing()
    if reason is None:
        return
    for item in items:
        if Path(str(item.path)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One llama-server for the session's loops (the 8-layer model), its first start by the
    start script; tests that break it leave it recovered by ralph-run."""
    served = Server(tmp_path_factory.mktemp("llama-server"), free_port())
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def healthy_server(server: Server) -> Server:
    """The session's server, healthy: the start script leaves a healthy one alone."""
    server.script("start")
    return server
