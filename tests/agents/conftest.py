"""Fixtures of the agent tests: the agent's binary (or a skip), an isolated HOME, a scenario."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_helpers import AgentScenario, isolate_home, require


@pytest.fixture
def agent_scenario(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str], AgentScenario]]:
    """`agent_scenario(NAME)`: a scenario for the real agent NAME, closed after the test."""
    built: list[AgentScenario] = []

    def make(agent: str) -> AgentScenario:
        require(agent)
        isolate_home(tmp_path / "home", monkeypatch)
        scenario = AgentScenario(tmp_path / "run", agent)
        scenario.root.mkdir(exist_ok=True)
        built.append(scenario)
        return scenario

    yield make
    for scenario in built:
        scenario.close()
