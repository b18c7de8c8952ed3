"""The iteration history: one line per iteration, from the loop's own events, kill -9 proof."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import pytest
from support.e2e import Scenario

from ralph_runner import events
from ralph_runner.deaths.history import History
from ralph_runner.durable import jsonl
from ralph_runner.output.bus import EventBus
from ralph_runner.output.console import Console

pytestmark = pytest.mark.timeout(90)


def history_of(workdir: Path) -> tuple[list[dict], jsonl.Skipped]:
    skipped = jsonl.Skipped()
    lines = [entry for _, entry in jsonl.read(workdir / ".ralph" / "iterations.jsonl", skipped)]
    return lines, skipped


def iteration(output: EventBus, number: int, item: str, size: int = 100) -> None:
    output.emit(
        events.IterationStarted(
            iteration=number,
            item=item,
            attempts=0,
            done=0,
            todo=1,
            skipped=0,
            deaths=0,
            prompt_size=size,
            prompt_bytes=size + 2,
        )
    )


def ended(output: EventBus, number: int, item: str, outcome: events.Outcome, **more) -> None:
    output.emit(events.IterationEnded(iteration=number, item=item, outcome=outcome, **more))


def bus() -> EventBus:
    return EventBus(Console(json_lines=True, stream=io.StringIO()))


def test_each_outcome_closes_its_line(tmp_path: Path) -> None:
    """Driven through a real event bus, as the loop drives it: done, death, strike, skip."""
    output = bus()
    path = tmp_path / "iterations.jsonl"
    history = History(path, "gpu-a")
    output.follow(history)
    iteration(output, 1, "a")
    ended(output, 1, "a", "done")
    iteration(output, 2, "b", size=12_000)
    output.emit(events.Death(death=1, phase="during-step", reason="x", fault="server gone"))
    ended(output, 2, "b", "death", reason="cancelled")
    iteration(output, 3, "b")
    ended(output, 3, "b", "strike", reason="exit 1", strikes=1)
    iteration(output, 4, "b")
    output.emit(events.Strike(item="b", strikes=2, of=2, reason="exit 1", output_tail=""))
    assert len(path.read_text().splitlines()) == 3  # a display event closes no line
    ended(output, 4, "b", "skipped", reason="exit 1", strikes=2)
    iteration(output, 5, "c")
    output.emit(events.Death(death=2, phase="start", reason="refused", fault="server gone"))
    ended(output, 5, "c", "gave-up")  # recovery failed: the run ended inside the iteration

    lines = [e for _, e in jsonl.read(path, jsonl.Skipped())]
    assert [(e["iteration"], e["outcome"], e["deaths"]) for e in lines] == [
        (1, "done", []),
        (2, "death", [1]),
        (3, "strike", []),
        (4, "skipped", []),
        (5, "gave-up", [2]),
    ]
    second = lines[1]
    assert (second["prompt_chars"], second["prompt_bytes"], second["host"]) == (
        12_000,
        12_002,
        "gpu-a",
    )
    assert second["event"] == "iteration" and second["seconds"] >= 0
    assert second["prompt_tokens"] is None and "no recorder" in second["tokens_note"]
    assert (second["reason"], lines[3]["strikes"], lines[3]["reason"]) == ("cancelled", 2, "exit 1")


def test_a_torn_last_line_is_read_around_and_not_fused_with_the_next(tmp_path: Path) -> None:
    path = tmp_path / "iterations.jsonl"
    history = History(path, "localhost")
    output = bus()
    output.follow(history)
    iteration(output, 1, "a")
    ended(output, 1, "a", "done")
    with path.open("ab") as torn:  # what a kill -9 in the middle of a write leaves
        torn.write(b'{"event":"iteration","iteration":2,"ite')
    iteration(output, 3, "c")
    ended(output, 3, "c", "done")
    skipped = jsonl.Skipped()
    lines = [e["iteration"] for _, e in jsonl.read(path, skipped)]
    assert lines == [1, 3]
    assert (skipped.torn, skipped.foreign) == (1, 0)
    assert "iterations.jsonl:2 (torn)" in skipped.text()


def test_a_real_run_writes_one_line_per_iteration_and_survives_kill_9(scenario: Scenario) -> None:
    """The stand-in dies during iteration 2 (a retried iteration is a line of its own); then the
    run is killed with -9 and started again: every line written before the kill is there."""
    items = ["first item", "second item", "third item", "fourth item"]
    scenario.prepare(items, agent_sleep="0.3")
    run = scenario.start()
    run.wait_agent(2)
    scenario.standin.trigger(die=True)
    run.wait_event("recovery", death=1)
    run.wait_agent(4)
    run.send(signal.SIGKILL)
    run.wait()
    before, _ = history_of(scenario.workspace)
    assert [e["outcome"] for e in before][:2] == ["done", "death"]
    assert before[1]["deaths"] == [1] and before[1]["item"] == "second item"

    again = scenario.start()
    assert again.wait() == 0, again.stderr
    lines, skipped = history_of(scenario.workspace)
    assert lines[: len(before)] == before  # append-only: nothing rewritten
    assert skipped.total == 0
    done = [e["item"] for e in lines if e["outcome"] == "done"]
    assert sorted(set(done)) == sorted(items)
    for entry in lines:
        assert entry["host"] == "localhost"
        assert entry["prompt_chars"] > 0 and entry["prompt_bytes"] >= entry["prompt_chars"]
        assert entry["seconds"] > 0
    records = scenario.records("death")
    assert [r["death"] for r in records] == [1]
    assert records[0]["iteration"] == before[1]["iteration"]
    assert json.loads((scenario.workspace / ".ralph" / "sources.json").read_text())["records"]
