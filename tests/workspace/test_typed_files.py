"""The files of .ralph/ are typed end to end: mypy finds no `Any` on the status and state paths,
and a state.json that an earlier ralph-run wrote still loads."""

from __future__ import annotations

import json
from pathlib import Path

from mypy import api

from ralph_runner.loop.state import State, Store

# The modules that read and write status.json and state.json (and check what they read).
TYPED = (
    "ralph_runner.workspace.status_file",
    "ralph_runner.loop.state",
    "ralph_runner.workspace.json_records",
)

# state.json as ralph-run wrote it before its records were typed (the shape of 77849c9).
EARLIER = {
    "agent_broken": {
        "items": ["a", "b"],
        "output_tail": "Error: no model",
        "reason": "exit 1",
        "skipped": ["c"],
    },
    "current_item": None,
    "death_times": [1767322000.5, 1767323000],
    "deaths": 2,
    "error": None,
    "iteration": 12,
    "last_death": {
        "death": 2,
        "fault": "hang",
        "item": "b",
        "phase": "during-step",
        "reason": "progress: no engine step in 41 s",
        "time": "2026-01-02T03:04:05+00:00",
    },
    "last_failure": {
        "item": "b",
        "output_tail": "Error: no model",
        "reason": "exit 1",
        "signatures": ["exit 1: Error: no model"],
    },
    "last_start": {
        "reason": None,
        "recovered": True,
        "seconds": 4.2,
        "time": "2026-01-02T03:00:00+00:00",
    },
    "limited": {
        "item": "b",
        "line": "usage limit reached",
        "reset_at": 1767323000.0,
        "source": "claude",
        "until": 1767323045.0,
    },
    "phase": None,
    "pid": 4242,
    "run_from": 4,
    "started": 1767320000.25,
    "status": "agent-broken",
    "streak_skipped": [],
    "strikes": {"a": 1, "b": 2},
}


def test_mypy_finds_no_any_on_the_status_and_state_paths(tmp_path: Path) -> None:
    """`--any-exprs-report`: every expression of these modules has a type that is not `Any`."""
    modules = [arg for name in TYPED for arg in ("-m", name)]
    report = tmp_path / "report"
    cache = ("--cache-dir", str(tmp_path / "cache"))
    out, err, status = api.run([*cache, "--any-exprs-report", str(report), *modules])
    assert status == 0, out + err
    rows = [line.split() for line in (report / "any-exprs.txt").read_text().splitlines()]
    anys = {row[0]: int(row[1]) for row in rows if row and row[0] in TYPED}
    assert anys == dict.fromkeys(TYPED, 0)


# the keys state.json gained since, with the values an earlier file's state gets
SINCE = {"item_deaths": {}, "suspects": [], "set_aside": []}  # deaths an item causes


def test_a_state_an_earlier_ralph_run_wrote_loads_and_saves_the_same(tmp_path: Path) -> None:
    """Every value kept; the keys added since come with their defaults."""
    store = Store(tmp_path)
    store.dir.mkdir()
    store.state_path.write_text(json.dumps(EARLIER, indent=2))
    state = store.load()
    assert state.to_dict() == {**EARLIER, **SINCE}
    assert state.last_death is not None and state.last_death["fault"] == "hang"
    store.save(state)
    assert json.loads(store.state_path.read_text()) == {**EARLIER, **SINCE}


def test_a_record_from_an_older_ralph_run_gets_the_keys_it_lacks(tmp_path: Path) -> None:
    """The first last_death had no number and no fault; unknown top-level keys are ignored."""
    older = {
        "iteration": 3,
        "last_death": {"time": "t", "phase": "before-iteration", "item": None, "reason": None},
        "from_a_newer_version": 1,
    }
    state = State.from_dict(older)
    assert state.iteration == 3
    assert state.last_death == {
        "death": 0,
        "time": "t",
        "phase": "before-iteration",
        "item": None,
        "reason": "",
        "fault": "",
    }
