"""`loop.workers: auto` against the stand-in (real git, real processes, the stand-in's real
/metrics): the governor admits workers while the server has headroom, sheds one when requests
queue or after a KV-cache-pressure death, and says why each time. Its rules one by one:
test_governor_policy.py."""

from __future__ import annotations

from typing import Any

import pytest
from support.e2e import Scenario
from support.workers import assert_clean, in_flight_at_most, prepare, strikes

pytestmark = pytest.mark.timeout(150)

QUICK = {  # the stand-in's /metrics (no progress probe here), looks and settling in test time
    "metrics": "{{ base_url | regex_replace('/v1/?$', '') }}/metrics",
    "every": 0.3,
    "settle": 1.0,
}


def auto(max_workers: int) -> dict[str, Any]:
    """The loop section's settings beside `workers: auto`."""
    return {"max_workers": max_workers, "governor": QUICK}


def levels(run: Any) -> list[tuple[int, int]]:
    return [(e["was"], e["workers"]) for e in run.of("governor")]


def test_auto_admits_workers_while_the_server_has_headroom(scenario: Scenario) -> None:
    prepare(scenario, [f"ok {n}" for n in range(1, 11)], workers="auto", sleep="1.5",
            loop=auto(4))  # fmt: skip
    run = scenario.start()
    status = run.wait_status(
        lambda s: (s.get("governor") or {}).get("workers") == 4, "4 workers admitted", 60
    )
    assert status["governor"]["max_workers"] == 4
    assert "nothing waiting" in status["governor"]["reason"]
    said = scenario.command("status")
    assert "governor:   4 of 4 workers (headroom for 1 s: nothing waiting" in said, said
    assert run.wait() == 0, run.stderr
    assert levels(run)[:2] == [(1, 2), (2, 4)], run.of("governor")
    assert scenario.marks() == ["x"] * 10
    assert in_flight_at_most(run) >= 3
    assert not strikes(run)
    assert_clean(scenario)


def test_auto_sheds_one_when_requests_queue_and_keeps_that_level_away(
    scenario: Scenario,
) -> None:
    # one sequence at a time, each call 16 tokens at 5 a second: a second worker's call waits
    prepare(scenario, [f"ok {n}" for n in range(1, 7)], workers="auto", sleep="0.2",
            loop=auto(4),
            standin={"MAX_NUM_SEQS": "1", "TOKENS_PER_SECOND": "5"})  # fmt: skip
    scenario.standin.trigger(busy=16)  # the stand-in agent asks for 16
    run = scenario.start()
    shed = run.wait_event("governor", timeout=60, was=2, workers=1)
    assert "waiting" in shed["reason"], shed
    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x"] * 6
    after = levels(run)[levels(run).index((2, 1)) + 1 :]
    assert all(workers < 2 for _, workers in after), "2 was shed from: not admitted again"
    assert not strikes(run)
    assert_clean(scenario)


def test_a_kv_cache_pressure_death_sheds_one_and_costs_no_strike(scenario: Scenario) -> None:
    prepare(scenario, [f"ok {n}" for n in range(1, 9)], workers="auto", sleep="1",
            loop=auto(4))  # fmt: skip
    run = scenario.start()
    run.wait_event("governor", timeout=60, workers=2)
    scenario.standin.trigger(die_on_prompt_chars=1)  # the seed's KV-cache assertion: death
    report = run.wait_event("report", timeout=60)
    assert "num_required_blocks" in (report["signature"] or ""), report
    why = "death 1's signature points at KV-cache pressure"
    shed = run.wait_event("governor", timeout=30, reason=why)
    assert shed["workers"] == shed["was"] - 1
    assert run.wait() == 0, run.stderr
    assert scenario.marks() == ["x"] * 8
    assert len(run.of("death")) == 1
    assert not strikes(run)
    assert_clean(scenario)


def test_auto_without_a_metrics_to_read_is_refused_before_anything_runs(
    scenario: Scenario,
) -> None:
    prepare(scenario, ["ok 1"], workers="auto", loop={"max_workers": 4})  # no progress probe
    run = scenario.start()
    assert run.wait() == 2
    assert "workers: auto reads the server's /metrics: add a `progress` probe" in run.stderr
    assert not run.of("iteration") and not run.of("step")
