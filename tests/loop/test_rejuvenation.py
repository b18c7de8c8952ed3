"""`health.rejuvenate` (loop/rejuvenation.py) on a real loop and a real stand-in that rots
(standin/rot.py): a server whose decode slows with age, or whose memory grows toward its OOM
kill, is restarted at an item boundary before it dies: no death, no strike, nothing in flight
killed. The signs' arithmetic alone: tests/loop/test_signs.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from support.e2e import Scenario, make_workspace, runbook
from support.workers import prepare as prepare_workers

pytestmark = pytest.mark.timeout(120)

FAST = {"TOKENS_PER_SECOND": "100"}  # the agent asks for 80 tokens: 0.8 s of decode an item
AGING = {**FAST, "DECODE_HALFLIFE": "6", "DECODE_FLOOR": "10"}
LEAKING = {**FAST, "LEAK_KB_PER_REQUEST": "6144", "MEMORY_LIMIT_MB": "200"}
STOP = (  # the old server goes first, and is gone before the start script looks
    'pid=$(cat {{ standin_dir }}/server.pid); kill -TERM -- "-$pid"; '
    "while kill -0 $pid 2>/dev/null; do sleep 0.05; done"
)
DECODE = {
    "decode_drop": 0.4, "every": 0.3, "warmup": 1, "baseline": 2, "window": 2,
    "min_tokens": 40, "sustained_for": 1.5, "min_age": 0, "at_most_every": 0,
}  # fmt: skip
MEMORY = {
    "memory_limit_mb": 200, "memory_horizon": 8, "every": 0.3, "warmup": 0.5, "window": 3,
    "sustained_for": 0.6, "min_age": 0, "at_most_every": 0,
}  # fmt: skip


def prepare(scenario: Scenario, items: int, rot: dict[str, str], rejuvenate: dict[str, Any],
            workers: int = 1) -> None:  # fmt: skip
    """A workspace of `items`, a stand-in that rots by `rot` (start_server.sh's environment,
    at every start), and demo.yaml's runbook with `health.rejuvenate`; with `workers`, the
    workers' tests' (support/workers.py)."""
    if workers > 1:
        texts = [f"ok {n}" for n in range(1, items + 1)]
        prepare_workers(scenario, texts, workers=workers, sleep="0.05", standin=rot,
                        engine_probe=True)  # fmt: skip
        book = yaml.safe_load(scenario.runbook_path.read_text())
    else:
        make_workspace(scenario.workspace, [f"item {n}" for n in range(1, items + 1)])
        book = runbook(agent_sleep="0.05", max_iterations=items * 3, engine_probe=True)
        scenario.standin.start(HEALTH_TIMEOUT="1", **rot)
    env = " ".join(f"{key}={json.dumps(value)}" for key, value in rot.items())
    start = f"{env} PYTHON={{{{ python }}}} HEALTH_TIMEOUT=1 {{{{ standin_start }}}}"
    start += " {{ port }} {{ standin_dir }}"
    book["recovery"]["steps"][0]["shell"] = start
    book["metrics"] = {"textfile": "ralph.prom"}  # in the workdir
    agent = book["loop"]["steps"][1]
    agent["shell"] = agent["shell"].replace(" --timeout ", " --max-tokens 80 --timeout ")
    book["health"]["rejuvenate"] = {
        **rejuvenate,
        "steps": [
            {"name": "stop the stand-in", "shell": STOP, "timeout": 10},
            {"name": "start the stand-in", "shell": start, "timeout": 30},
        ],
    }
    scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))


def assert_no_loss(scenario: Scenario, run_events: list[dict[str, Any]]) -> None:
    """Every item done, no death, no strike, no retry."""
    assert scenario.marks() == ["x"] * len(scenario.marks())
    assert scenario.records("death") == []
    state = scenario.state()
    assert state["deaths"] == 0 and state["strikes"] == {}
    kinds = {e["event"] for e in run_events}
    assert not kinds & {"death", "retry", "strike", "skip"}


def test_decode_slowing_with_age_is_restarted_at_a_boundary_and_is_fast_again(
    scenario: Scenario,
) -> None:
    prepare(scenario, 12, AGING, DECODE)
    pid_before = scenario.standin.pid
    run = scenario.start()
    assert run.wait(100) == 0, run.stderr
    done = run.of("rejuvenated")
    assert done, run.events
    first = done[0]
    assert first["recovered"] and first["signs"] == ["decode_drop"]
    # taken at a boundary: no attempt started between the restart's due and its end (but
    # the one in flight then, whose start event may come a moment after)
    kinds = [e["event"] for e in run.events]
    at, end = kinds.index("rejuvenation-due"), kinds.index("rejuvenated")
    started = [e["item"] for e in run.events[at:end] if e["event"] == "iteration"]
    assert set(started) <= set(run.events[at]["in_flight"])
    # before the floor for longer than declared: below the threshold for sustained_for, plus
    # at most one item's landing (an item decodes in under 2 s at the threshold's speed)
    records = scenario.records()
    rejuvenation = next(r for r in records if r["event"] == "rejuvenation")
    baseline = rejuvenation["baseline"]["decode"]
    assert rejuvenation["before"]["decode"] <= baseline * (1 - DECODE["decode_drop"])
    assert rejuvenation["before"]["decode"] > 10  # not yet at the stand-in's floor
    assert scenario.standin.pid != pid_before
    # throughput after the restart, measured by the same signs: back at its baseline
    after = next(r for r in records if r["event"] == "rejuvenation-after")
    assert after["rejuvenation"] == 1
    assert after["after"]["decode"] >= baseline * 0.8
    assert_no_loss(scenario, run.events)
    status = json.loads((scenario.workspace / ".ralph" / "status.json").read_text())
    assert status["rejuvenation"]["count"] == len(done)
    assert status["rejuvenation"]["by_sign"] == {"decode_drop": len(done)}
    assert "rejuvenation 1 of vLLM stand-in (decode_drop): restarted" in scenario.death_log()
    # the operator's other views: status, deaths, the report, the Prometheus textfile
    assert f"rejuvenated: {len(done)} (decode_drop {len(done)})" in scenario.command("status")
    deaths = scenario.command("deaths")
    assert "no deaths recorded" in deaths
    assert f"{len(done)} rejuvenation" in deaths and "decode_drop" in deaths
    scenario.command("report", ".")
    page = (scenario.workspace / ".ralph" / "report.html").read_text(encoding="utf-8")
    assert 'id="rejuvenations"' in page and f"{baseline:.1f}" in page
    textfile = (scenario.workspace / "ralph.prom").read_text(encoding="utf-8")
    assert f'sign="decode_drop"}} {len(done)}.0' in textfile


def test_with_two_workers_the_attempts_in_flight_land_before_the_restart(
    scenario: Scenario,
) -> None:
    prepare(scenario, 12, AGING, DECODE, workers=2)
    run = scenario.start()
    assert run.wait(100) == 0, run.stderr
    due = run.wait_event("rejuvenation-due")
    assert run.of("rejuvenated", recovered=True)
    kinds = [e["event"] for e in run.events]
    at, end = kinds.index("rejuvenation-due"), kinds.index("rejuvenated")
    # No attempt started once it fell due (the items in flight then are counted under the
    # scheduler's lock; an attempt's own start event may come a moment after), and each item
    # in flight then landed before the restart, done: none was killed.
    in_flight = due["in_flight"]
    assert in_flight
    started = [e["item"] for e in run.events[at:end] if e["event"] == "iteration"]
    assert set(started) <= set(in_flight)
    landed = {e["item"]: e["outcome"] for e in run.events[:end] if e["event"] == "iteration-ended"}
    assert all(landed.get(item) == "done" for item in in_flight), (in_flight, landed)
    assert not [e for e in run.events[end:] if e["event"] == "iteration-ended"
                and e["item"] in in_flight]  # fmt: skip
    assert_no_loss(scenario, run.events)


def test_a_memory_leak_is_restarted_before_the_servers_oom_kill(scenario: Scenario) -> None:
    prepare(scenario, 24, LEAKING, MEMORY)
    run = scenario.start()
    assert run.wait(100) == 0, run.stderr
    done = run.of("rejuvenated")
    assert done and all(d["signs"] == ["memory"] and d["recovered"] for d in done)
    assert "Out of memory" not in scenario.standin.log()
    record = next(r for r in scenario.records() if r["event"] == "rejuvenation")
    assert record["before"]["resident_mb"] < 200
    assert_no_loss(scenario, run.events)
