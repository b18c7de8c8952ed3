"""One reading of a late answer (issue 36; docs: hangs, "Busy is never dead"): a CPU engine
starves its own API server, so `/v1/models` may not answer within its probe's timeout while the
engine works. Through real rounds of `Health` against a scripted vLLM on 127.0.0.1:

- the engine generating (tokens moving, requests active): the late `/v1/models` is busy, the
  round passes, and its detail says why;
- the engine idle: the same late answer is a timeout, and a death once confirmed;
- the engine working but its tokens stopped past the hang bound: the round fails as stalled;
- a refused connection stays a failure at once, whatever the engine did before.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from engine_helpers import Engine
from support.standin import wait_for

from ralph_runner import probes
from ralph_runner.liveness.health import Health, ProbeSpec
from ralph_runner.probes import http as http_probe
from ralph_runner.probes import progress
from ralph_runner.process.connection import for_host

pytestmark = pytest.mark.system

STALL = 2.0  # s: the hang bound (fixed, for the test)


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine() as scripted:
        yield scripted


@pytest.fixture
def health(engine: Engine) -> Iterator[Health]:
    watching = progress.Params.model_validate(
        {
            "metrics": engine.metrics_url,
            "completion": {"url": engine.url, "model": "m"},
            "stall_after": STALL,
        }
    )
    models = http_probe.Params.model_validate({"url": f"{engine.url}/models", "status": 200})
    specs = [
        ProbeSpec("engine progress", "progress", watching, timeout=1.0),
        ProbeSpec("models endpoint", "http", models, timeout=0.5),
    ]
    with Health(specs, failures_before_dead=2, interval=0.1, connection=for_host({})) as made:
        yield made


def by_name(results: list[probes.ProbeResult]) -> dict[str, probes.ProbeResult]:
    return {result.name: result for result in results}


def test_a_late_models_answer_while_the_engine_generates_is_busy(engine, health):
    engine.busy(tokens_per_second=50, running=1, waiting=0)
    health.round()  # the first look: the counters remembered
    engine.models_delay = 2.0  # the API server starved by its engine
    wait_for(lambda: engine.generation_tokens > 0, 5, "tokens")
    alive, rounds = health.check()
    assert alive, rounds
    models = by_name(rounds[-1])["models endpoint"]
    assert models.ok and "timed out" in models.detail and "the engine works" in models.detail


def test_the_same_late_answer_from_an_idle_engine_is_a_death(engine, health):
    health.round()
    engine.models_delay = 2.0
    alive, rounds = health.check()
    assert not alive
    failed = [by_name(r)["models endpoint"] for r in rounds]
    assert [r.reason for r in failed] == ["timeout", "timeout"], failed


def test_a_late_answer_is_busy_only_on_the_hang_bounds_clock(engine, health):
    """Work active, no token: busy until the bound, then the progress probe's stall fails the
    round (the late answer does not hide a hung engine)."""
    engine.running = 1
    health.round()
    engine.models_delay = 2.0
    first, rounds = health.check()
    assert first, rounds
    _, rounds = wait_for(lambda: (r := health.check()) and not r[0] and r, STALL + 10, "dead")
    assert by_name(rounds[-1])["engine progress"].reason == "stalled", rounds


def test_a_refused_connection_is_a_failure_at_once(engine, health):
    engine.busy(tokens_per_second=50, running=1, waiting=0)
    health.round()
    engine.close()
    health.client.close()  # its kept-alive connections, which the closed server's threads serve
    health.client = httpx.Client()  # a new one, as after a restart: connections refused
    alive, rounds = health.check()
    assert not alive
    assert {r.reason for r in rounds[0]} == {"refused"}, rounds
