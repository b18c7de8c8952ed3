"""The loop in process: a real Plan from a runbook in tmp_path, a real git workdir, `sh` steps as
real child processes, and the Runner and its Iterations driven by a direct call (no ralph-run
subprocess): each iteration says how it ended (`IterationEnded`), and the history writes that.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path

import pytest

import ralph_runner.loop
from ralph_runner import events
from ralph_runner.errors import ExitCode
from ralph_runner.loop.runner import Runner
from ralph_runner.loop.state import Store
from ralph_runner.output.bus import EventBus
from ralph_runner.output.console import Console
from ralph_runner.runbook import plan
from ralph_runner.workspace.status_file import Status

pytestmark = pytest.mark.timeout(60)

# The agent: an item that starts with "ok" is ticked and committed; any other fails (exit 3).
RUNBOOK = """
name: in-process loop
workdir: "{{ runbook_dir }}/work"
checklist: { path: CHECKLIST.md, strikes: 2 }
prompt: "Do exactly this: {{ item.text }}"
loop:
  steps:
    - name: agent
      shell: |
        case {{ item.text | quote }} in
          ok*) sed -i '0,/^- \\[ \\] /s//- [x] /' CHECKLIST.md && git commit -qam "done" ;;
          *) echo "cannot do {{ item.text }}"; exit 3 ;;
        esac
      timeout: 20
    - verify: { checked: true, committed: true }
"""


class Seen:
    """A follower that keeps every event."""

    def __init__(self) -> None:
        self.events: list[events.Event] = []

    def on_event(self, event: events.Event) -> None:
        self.events.append(event)

    def ended(self) -> list[events.IterationEnded]:
        return [e for e in self.events if isinstance(e, events.IterationEnded)]


def workspace(tmp_path: Path, items: list[str]) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "CHECKLIST.md").write_text("".join(f"- [ ] {item}\n" for item in items))
    for args in (
        ["init", "-q"],
        ["config", "user.email", "t@example.com"],
        ["config", "user.name", "t"],
        ["add", "-A"],
        ["commit", "-qm", "start"],
    ):
        subprocess.run(["git", *args], cwd=work, check=True)
    runbook = tmp_path / "runbook.yaml"
    runbook.write_text(RUNBOOK)
    return runbook


def run_loop(runbook: Path) -> tuple[int, Seen]:
    (selected,) = plan.build(runbook)
    bus = EventBus(Console(json_lines=True, stream=io.StringIO()))
    seen = Seen()
    bus.follow(seen)
    return Runner(selected, bus).run(), seen


def history(runbook: Path) -> list[dict[str, object]]:
    path = runbook.parent / "work" / ".ralph" / "iterations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_item_done_ends_its_iteration_done(tmp_path: Path) -> None:
    runbook = workspace(tmp_path, ["ok first"])
    code, seen = run_loop(runbook)
    assert code == ExitCode.DONE
    assert seen.ended() == [events.IterationEnded(iteration=1, item="ok first", outcome="done")]
    kinds = [e.kind for e in seen.events]
    assert kinds.index("done") < kinds.index("iteration-ended") < kinds.index("summary")
    (line,) = history(runbook)
    assert (line["outcome"], line["item"], line["files_changed"]) == ("done", "ok first", 1)


def test_a_failing_step_is_a_strike_and_the_last_strike_a_skip(tmp_path: Path) -> None:
    runbook = workspace(tmp_path, ["hard item", "ok after"])
    code, seen = run_loop(runbook)
    assert code == ExitCode.DONE
    strike, skipped, done = seen.ended()
    assert (strike.iteration, strike.outcome, strike.strikes) == (1, "strike", 1)
    assert strike.reason is not None and "exit 3" in strike.reason
    assert (skipped.iteration, skipped.outcome, skipped.strikes) == (2, "skipped", 2)
    assert (done.item, done.outcome) == ("ok after", "done")
    assert [e.kind for e in seen.events if e.kind in ("strike", "skip")] == ["strike"] * 2 + [
        "skip"
    ]
    lines = history(runbook)
    assert [(e["outcome"], e.get("strikes")) for e in lines] == [
        ("strike", 1),
        ("skipped", 2),
        ("done", None),
    ]
    checklist = (runbook.parent / "work" / "CHECKLIST.md").read_text()
    assert checklist == "- [!] hard item\n- [x] ok after\n"


def test_quick_steps_do_not_rewrite_the_status_with_workers_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """status.json is rewritten when a step that takes time starts, not for a quick one (verify,
    ensure_alive: milliseconds), with one worker or many: one step runner for both. With
    `workers: 2` the pool's own step runner once rewrote it at every step."""
    runbook = workspace(tmp_path, ["ok first", "ok second"])
    book = runbook.read_text().replace("loop:\n", "loop:\n  workers: 2\n")
    quick = 20  # quick steps per attempt, after the agent's
    book += "".join("    - verify: { checked: false, committed: false }\n" for _ in range(quick))
    runbook.write_text(book)
    writes: list[int] = []
    original = Store.write_status

    def counted(store: Store, status: Status) -> None:
        writes.append(1)
        original(store, status)

    monkeypatch.setattr(Store, "write_status", counted)
    code, seen = run_loop(runbook)
    assert code == ExitCode.DONE, seen.events
    attempts = len(seen.ended())  # the second may come again: its agent ticks the first item
    assert [e.outcome for e in seen.ended()].count("done") == 2
    # a few writes an attempt (its start, its agent step, its end), not one per quick step
    assert 0 < len(writes) < attempts * quick / 2, (
        f"{len(writes)} status writes, {attempts} attempts"
    )


def test_each_rule_of_an_attempt_is_written_once() -> None:
    """One loop: the step runner, the after-failure accounting, a death's facts and the service
    check are each defined once in the loop package (the serial loop and the pool of workers
    once held a copy each), and the pool's unused `_room` is gone."""
    loop = Path(ralph_runner.loop.__file__).parent
    source = "\n".join(p.read_text() for p in sorted(loop.glob("*.py")))
    for name in ("_step", "_account_for", "facts", "ensure_service"):
        found = re.findall(rf"^\s*def _?{name.lstrip('_')}\(", source, re.MULTILINE)
        assert len(found) == 1, (name, found)
    assert "_room" not in source
