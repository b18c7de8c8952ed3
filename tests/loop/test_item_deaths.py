"""Deaths an item causes (loop/blame.py, docs/deaths.md), against the stand-in born broken at
every start (start_server.sh's FAULTS, so each restart by the recovery is as broken): a prompt
over N characters kills its engine, as the seed's KV-cache assertion did; or every second
agent call does, whatever its prompt. Real git, real processes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from support.e2e import RalphRun, Scenario, make_workspace, runbook
from support.workers import assert_clean, prepare

pytestmark = pytest.mark.timeout(120)

POISON = "poison: " + "x" * 300  # its prompt is over LIMIT characters; the others' are not
LIMIT = 250


def broken_at_every_start(
    scenario: Scenario, faults: dict[str, int], data: dict[str, Any] | None = None
) -> None:
    """The runbook `data` (e2e's), its recovery starting the stand-in with `faults` too."""
    data = data or runbook()
    step = data["recovery"]["steps"][0]
    step["shell"] = f"FAULTS={json.dumps(json.dumps(faults))} {step['shell']}"
    scenario.runbook_path.write_text(yaml.safe_dump(data, sort_keys=False))
    scenario.standin.start(HEALTH_TIMEOUT="1", FAULTS=json.dumps(faults))


def history(scenario: Scenario) -> list[dict[str, Any]]:
    path = scenario.workspace / ".ralph" / "iterations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_set_aside_once(scenario: Scenario, run: RalphRun, deaths: int) -> None:
    """The poison item set aside once after `deaths` deaths in a row, said everywhere."""
    (aside,) = run.of("item-set-aside")
    assert aside["item"] == POISON and aside["deaths"] == deaths, aside
    assert f"its prompt {aside['prompt_size']} characters" in aside["reason"], aside
    assert run.of("summary")[-1]["set_aside"] == 1
    assert scenario.state()["set_aside"] == [POISON]
    assert [line["outcome"] for line in history(scenario)].count("set-aside") == 1
    blamed = [r["blame"] for r in scenario.records("death") if r.get("blame")]
    assert [(b["item"], b["deaths"], b["set_aside"]) for b in blamed][-deaths:] == [
        (POISON, n, n == deaths) for n in range(1, deaths + 1)
    ], blamed


def test_an_item_whose_prompt_kills_the_server_is_set_aside_and_the_night_goes_on(
    scenario: Scenario,
) -> None:
    """Three items, the middle one's prompt kills the server every time it is sent: it is set
    aside after 2 deaths in a row (the default), no strike; the others are done; exit 0 (on
    main before this rule: the crash-loop breaker, exit 4, the third item never ran)."""
    make_workspace(scenario.workspace, ["first thing", POISON, "third thing"])
    broken_at_every_start(scenario, {"die_on_prompt_chars": LIMIT})
    run = scenario.start()
    assert run.wait() == 0, (run.events[-8:], run.stderr)
    assert scenario.marks() == ["x", "!", "x"]
    assert len(run.of("death")) == 2 and not run.of("strike")
    assert_set_aside_once(scenario, run, deaths=2)
    assert "set aside: " in scenario.command("status", str(scenario.workspace))
    told = scenario.command("deaths", str(scenario.workspace))
    (row,) = [line for line in told.splitlines() if "set aside" in line and "poison" in line]
    assert row.split()[:3] == ["2", "2", "2"], told  # deaths, alone, attempts


def test_with_workers_the_suspects_run_alone_and_every_other_item_lands(
    scenario: Scenario,
) -> None:
    """Five items, three workers, one poison: the first death has several items in flight and
    blames none of them alone; the suspects then run one at a time, so the culprit is found in
    2 more deaths and every other item lands (on main: every death killed all in flight, exit
    4, nothing landed)."""
    items = ["ok 1", "ok 2", POISON, "ok 4", "ok 5"]
    # the agents think before their call: the poison's call comes while the others still think
    # (their steps in flight), so the first death has all three in flight
    thinking = "2 if item.text.startswith('poison') else 5"
    prepare(scenario, items, workers=3, sleep=thinking, engine_probe=False)
    data = yaml.safe_load(scenario.runbook_path.read_text())
    scenario.standin.stop()
    broken_at_every_start(scenario, {"die_on_prompt_chars": LIMIT}, data=data)
    run = scenario.start()
    assert run.wait() == 0, (run.events[-8:], run.stderr)
    assert scenario.marks() == ["x", "x", "!", "x", "x"]
    assert sorted(e["item"] for e in run.of("worker-landed")) == sorted(
        i for i in items if i != POISON
    )
    first, *rest = [r["blame"] for r in scenario.records("death")]
    assert POISON in first["in_flight"] and len(first["in_flight"]) > 1, first
    assert first["item"] is None and len(rest) == 2, rest  # blamed alone: 2 more deaths
    assert_set_aside_once(scenario, run, deaths=2)
    assert_clean(scenario)


def test_a_server_that_dies_at_every_second_call_sets_nothing_aside(scenario: Scenario) -> None:
    """Whatever the prompt, every second generation kills the engine (the start script's own
    check is the first of each server): each item is in flight at one death, never two in a
    row: no item is set aside, every item is done."""
    make_workspace(scenario.workspace, ["one", "two", "three", "four"])
    broken_at_every_start(scenario, {"die_at_generation": 3})
    run = scenario.start()
    assert run.wait() == 0, (run.events[-8:], run.stderr)
    assert scenario.marks() == ["x"] * 4
    assert len(run.of("death")) >= 2 and not run.of("item-set-aside")
    assert "set_aside" not in run.of("summary")[-1]


def test_a_shorter_prompt_on_the_retry_gets_the_item_done(scenario: Scenario) -> None:
    """The runbook reacts before it gives up: its prompt drops the long part when the item has
    caused a death (`item.deaths`), and the item is done on its second attempt."""
    make_workspace(scenario.workspace, ["first thing", POISON])
    data = runbook()
    data["prompt"] = (
        "{% if item.deaths %}Do the item, briefly: {{ item.text[:40] }}"
        "{% else %}Read PLAN.md. Do exactly this item, tick it, commit: {{ item.text }}{% endif %}"
    )
    broken_at_every_start(scenario, {"die_on_prompt_chars": LIMIT}, data=data)
    run = scenario.start()
    assert run.wait() == 0, (run.events[-8:], run.stderr)
    assert scenario.marks() == ["x", "x"]
    assert len(run.of("death")) == 1 and not run.of("item-set-aside")
    tries = [e for e in run.of("iteration") if e["item"] == POISON]
    assert len(tries) == 2 and tries[1]["prompt_size"] < LIMIT < tries[0]["prompt_size"], tries
