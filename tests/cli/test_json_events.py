"""`--json` is a contract: every event's name and its fields, pinned (users parse these lines).

The table below is what ralph-run wrote before the events were typed (issue 30), plus what was
added since (`iteration-ended`; `item-set-aside` and the summary's `set_aside`, deaths an item
causes). A renamed, dropped, reordered or added field fails here;
change the table only with docs/watching.md, where the events are documented for users.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from ralph_runner import events
from ralph_runner.output.bus import EventBus
from ralph_runner.output.console import Console
from ralph_runner.output.lines import human_line

# name: (fields always on the line, in order; fields said only when they apply)
JSON_EVENTS: dict[str, tuple[list[str], list[str]]] = {
    "resume": (["iteration", "deaths", "item"], []),
    "iteration": (
        ["iteration", "item", "attempts", "done", "todo", "skipped", "deaths", "prompt_size",
         "prompt_bytes"],
        [],
    ),
    "step": (["step", "action"], ["worker"]),
    "step-done": (
        ["step", "ok", "exit_code", "timed_out", "killed", "status", "seconds"],
        ["stalled", "worker"],
    ),
    "watch": (["step", "killed"], []),
    "output": (["step", "text"], []),
    "done": (["item"], []),
    "retry": (["item", "reason"], []),
    "strike": (["item", "strikes", "of", "reason", "output_tail"], []),
    "skip": (["item", "strikes"], []),
    "item-set-aside": (["item", "deaths", "signature", "prompt_size", "reason"], []),
    "agent-broken": (
        ["item", "previous_item", "reason", "output_tail", "skipped", "exit_code"], []
    ),
    "limited": (
        ["item", "source", "line", "reset_at", "until", "reset", "seconds", "guessed",
         "ends_run"],
        ["exit_code"],
    ),
    "limited-wait": (["item", "seconds", "until"], []),
    "iteration-ended": (["iteration", "item", "outcome"], ["reason", "strikes", "limit"]),
    "interrupted": (["signal", "exit_code"], []),
    "summary": (
        ["stopped_at_max", "iterations", "done", "todo", "skipped", "deaths", "signatures",
         "seconds"],
        ["set_aside", "malformed"],
    ),
    "warning": (["message"], []),
    "death": (["death", "phase", "reason", "fault"], []),
    "capture": (["collectors"], ["during_recovery"]),
    "report": (["death", "log", "signature"], ["written", "error"]),
    "start": (["service", "reason"], []),
    "started": (["recovered", "seconds", "attempts", "reason", "by"], []),
    "recovery-wait": (["by", "seconds"], []),
    "recovery-step": (["attempt", "step"], ["skipped"]),
    "recovery-failed": (["attempt", "reason", "retry_in"], []),
    "recovery": (["death", "recovered", "attempts", "seconds", "reason", "by"], []),
    "recorder": (["message"], []),
    "receipt": (
        ["iteration", "item", "requests", "request_errors", "prompt_tokens", "generated_tokens",
         "tokens_estimated", "first_token_seconds", "generation_seconds", "request_seconds"],
        [],
    ),
    "pause-requested": (["now", "by"], []),
    "paused": (["iteration", "item", "now", "killed", "by"], []),
    "resumed": (["iteration", "seconds"], []),
    "pause-step": (["step"], ["skipped"]),
    "resume-step": (["step"], ["skipped"]),
    "pause-steps": (["ok", "ran", "seconds", "error"], []),
    "resume-steps": (["ok", "ran", "seconds", "error"], []),
    "block-step": (["block", "step"], ["skipped"]),
    "block-steps": (["block", "ok", "ran", "seconds", "error"], ["held"]),
    "fleet": (["hosts", "forks"], []),
    "host-done": (["exit_code"], []),  # and `host`, as every event a fleet hands on
    "host-says": (["text"], []),
    "fleet-summary": (["hosts", "exit_code"], []),
    "worker-started": (["worker", "iteration", "item", "branch", "base", "strikable"], []),
    "worker-landed": (["worker", "item", "commits", "head"], []),
    "worker-conflict": (["worker", "item", "conflicts", "of", "reason"], []),
    "worker-retry": (["worker", "item", "reason", "waits"], []),
    "governor": (["workers", "was", "of", "reason"], []),
    "rejuvenation-due": (["signs", "reason", "in_flight"], []),
    "rejuvenated": (["rejuvenation", "signs", "reason", "recovered", "seconds", "before",
                     "baseline"], ["pid_before", "pid_after", "error"]),
}  # fmt: skip


def sample(spec: dataclasses.Field[object]) -> object:
    """A value of the field's type that --json never leaves out."""
    kind = str(spec.type)
    if kind.startswith("bool"):
        return not spec.metadata.get(events.OMITTED, False)
    if kind.startswith(("int", "float")):
        return 1
    if kind.startswith("list"):
        return []
    if kind.startswith("dict"):
        return {}
    return "set"


def build(kind: type[events.Event], optional: bool) -> events.Event:
    """One instance: every required field given, the optional ones too when `optional`."""
    given = {}
    for spec in dataclasses.fields(kind):
        if spec.name == "host":
            continue
        if spec.default is dataclasses.MISSING or optional:
            given[spec.name] = sample(spec)
    if kind in (events.HostDone, events.HostSays):
        given["host"] = "gpu-a"
    return kind(**given)


def line_of(event: events.Event) -> dict[str, object]:
    stream = io.StringIO()
    EventBus(Console(json_lines=True, stream=stream)).emit(event)
    return json.loads(stream.getvalue())


def test_every_event_kind_is_in_the_table() -> None:
    assert sorted(events.KINDS) == sorted(JSON_EVENTS)


@pytest.mark.parametrize("name", sorted(JSON_EVENTS))
def test_the_json_line_has_exactly_the_pinned_fields(name: str) -> None:
    always, optional = JSON_EVENTS[name]
    kind = events.KINDS[name]
    host = ["host"] if kind in (events.HostDone, events.HostSays) else []
    plain = line_of(build(kind, optional=False))
    assert plain["event"] == name and isinstance(plain["time"], float)
    assert list(plain)[2:] == always + host
    full = line_of(build(kind, optional=True))
    assert sorted(list(full)[2:]) == sorted(always + optional + host)
    assert [k for k in full if k in always] == always  # the order users saw


def test_a_fleet_hands_on_a_hosts_event_with_host_last_and_reads_it_back() -> None:
    death = events.Death(death=3, phase="during-step", reason="refused", fault="server gone")
    shown = line_of(dataclasses.replace(death, host="gpu-b"))
    assert list(shown) == ["event", "time", "death", "phase", "reason", "fault", "host"]
    assert events.from_json(shown) == dataclasses.replace(death, host="gpu-b")


def test_a_kind_or_field_from_a_newer_loop_is_passed_on_as_it_is() -> None:
    newer = {"event": "brand-new", "time": 1.0, "answer": 42}
    unknown = events.from_json(newer)
    assert isinstance(unknown, events.Unknown) and unknown.kind == "brand-new"
    line = line_of(unknown)  # once: two lines written a millisecond apart differ in `time`
    assert line == {"event": "brand-new", "time": line["time"], "answer": 42}
    grown = {"event": "done", "time": 1.0, "item": "a", "why": "new field"}
    passed = events.from_json(grown)
    assert isinstance(passed, events.Unknown)
    assert passed.json_fields() == {"item": "a", "why": "new field"}


def test_every_event_but_iteration_ended_has_a_human_line() -> None:
    # iteration-ended repeats for the history what done, retry, strike, skip, limited and
    # paused said to people already
    silent = [
        name
        for name, kind in events.KINDS.items()
        if human_line(build(kind, optional=True), lambda _colour, text: text) is None
    ]
    assert silent == ["iteration-ended"]
