"""`ralph-run top`'s reading and drawing without a terminal: the states it infers from
status.json, the rates and sparklines, a remote read equal to a local one, and a loop whose
read never returns holding up no other row. Fast: no loop runs (one `bash` for the remote read).
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from support.standin import wait_for

from ralph_runner.commands import top
from ralph_runner.commands import top_view as view
from ralph_runner.process import connection
from ralph_runner.workspace import status_file
from ralph_runner.workspace.status_file import CheckedStatus

D = 1_700_000_000.0  # the death's time


def death_row(**changes: Any) -> CheckedStatus:
    """status.json as the loop writes it at a death during its agent step, as top reads it."""
    row = {
        "status": "running",
        "running": True,
        "iteration": 3,
        "item": "b",
        "deaths": 1,
        "last_death": {"death": 1, "time": "2023-11-14T22:13:20+00:00", "phase": "during-step"},
        "step_started": D - 4.0,
        "updated": D + 0.01,
        "paused": False,
        "pause": None,
        "limited": None,
    }
    status = status_file.parse({**row, **changes}, Path("status.json"))
    return {**status, "pause_left": False}


def test_a_recovery_shows_from_the_death_until_the_next_step_writes_the_status() -> None:
    assert view.state_text(death_row(), D, D + 3.2) == "recovering 3s"
    # the iteration after the recovery starts: no step yet
    assert view.state_text(death_row(step_started=None, updated=D + 6), D, D + 6) == "running"
    # its first step starts, after the death
    assert view.state_text(death_row(step_started=D + 6, updated=D + 6), D, D + 7) == "running"
    # an earlier death: this one's record has not been written yet, or it is an old one
    assert view.state_text(death_row(deaths=2), D, D + 3) == "running"
    assert view.state_text(death_row(), None, D + 3) == "running"
    paused = death_row(paused=True, pause={"state": "paused", "since": D + 8})
    assert view.state_text(paused, D, D + 9) == "paused"
    gone = death_row(running=False)
    assert view.state_text(gone, D, D + 9) == "dead"  # killed -9 while it recovered
    assert view.state_text({**gone, "status": "gave-up"}, D, D + 9) == "gave-up"


def test_a_usage_limit_wait_counts_down_and_a_pause_on_its_way_shows() -> None:
    limited = death_row(deaths=0, last_death=None, limited={"until": D + 125.5})
    assert view.state_text(limited, None, D) == "limited 2m05s"
    pausing = death_row(deaths=0, pause={"state": "pausing"})
    assert view.state_text(pausing, None, D) == "pausing"


def test_items_per_hour_count_the_done_iterations_of_the_last_hour() -> None:
    now = D
    lines = [{"started": now - 1800 + 60 * i, "outcome": "done", "seconds": 50} for i in range(3)]
    lines.append({"started": now - 100, "outcome": "strike", "seconds": 50})
    lines.insert(0, {"started": now - 7200, "outcome": "done", "seconds": 50})  # too old
    assert view.per_hour(lines, now) == "6.0"  # 3 in the last 30 minutes
    assert view.per_hour(lines[-1:], now) == "0.0"
    assert view.per_hour([{"started": now - 5, "outcome": "done"}], now) == "60"  # a minute
    assert view.per_hour([], now) == ""
    # an ended loop: up to its last iteration's end, not to now
    ended = [{"started": D, "outcome": "done", "seconds": 300.0}]
    ended.append({"started": D + 300, "outcome": "done", "seconds": 300.0})
    assert view.per_hour(ended, None) == "12"


def test_sparklines_scale_to_their_top_and_a_missing_sample_is_a_gap() -> None:
    assert view.sparkline([0.0, 50.0, 100.0, None], 4, 100.0) == "▁▅█ "
    assert view.sparkline([1.0, 2.0], 4) == "  ▅█"  # right-aligned, scaled to the largest
    assert view.sparkline([0.0, 0.0], 2) == "▁▁"
    samples = [
        {"t": 10.0, "sample": {"metrics": {view.GENERATED: 100.0, view.KV_CACHE: 0.5}}},
        {"t": 12.0, "sample": {"metrics": {view.GENERATED: 300.0, view.RUNNING: 2.0}}},
        {"t": 13.0, "sample": {"metrics": {}, "error": "refused"}},  # the server is down
        {"t": 14.0, "sample": {"metrics": {view.GENERATED: 20.0}}},  # restarted: from 0
        {"t": 15.0, "sample": {"metrics": {view.GENERATED: 60.0}}},
    ]
    found = view.series(samples)
    assert found["tok/s"] == [None, 100.0, None, None, 40.0]
    assert found["kv %"] == [50.0, None, None, None, None]
    assert found["run"] == [None, 2.0, None, None, None]


def write_workdir(workdir: Path, iteration: int = 4) -> None:
    """A workdir's .ralph/ with the files a running loop keeps there."""
    state = workdir / ".ralph"
    (state / "recorder").mkdir(parents=True)
    now = time.time()
    status = death_row(iteration=iteration, deaths=0, last_death=None, step_started=now - 2)
    status.update(pid=None, running=False, status="finished", done=3, todo=1, skipped=0)
    (state / "status.json").write_text(json.dumps(status, indent=2) + "\n")
    failure = {"item": "b", "reason": "exit 1", "output_tail": "Error: no model\ntry again"}
    (state / "state.json").write_text(json.dumps({"death_times": [D], "last_failure": failure}))
    lines = [
        {
            "iteration": i,
            "outcome": "done",
            "started": now - 100 + i,
            "seconds": 1.5,
            "item": f"item {i}",
            "commit": "0123456789abcdef",
            "insertions": 4,
            "deletions": 1,
            "receipt": {"prompt_tokens": 12000, "generated_tokens": 300},
        }
        for i in range(1, iteration)
    ]
    torn = '{"iteration": 9, "outc'
    (state / "iterations.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + torn)
    ring = [
        {"t": now - 5 + i, "sample": {"metrics": {view.GENERATED: 40.0 * i * i}}} for i in range(5)
    ]
    ring.insert(2, {"t": now - 3, "log": "INFO engine: 40 tokens/s"})
    text = "".join(json.dumps(x) + "\n" for x in ring)
    (state / "recorder" / "segment-00000001.jsonl").write_text(text)


def test_a_remote_read_gives_what_a_local_read_gives(tmp_path: Path) -> None:
    write_workdir(tmp_path / "loop")
    here = view.read_local(str(tmp_path / "loop"), detailed=True)
    there = view.read_remote(connection.Local(), str(tmp_path / "loop"), True, timeout=10)
    assert here.status == there.status and here.status is not None
    assert here.status["iteration"] == 4
    assert here.history == there.history and [x["iteration"] for x in here.history] == [1, 2, 3]
    assert here.samples == there.samples and here.samples is not None
    assert len(here.samples) == 5 and here.log == there.log == ["INFO engine: 40 tokens/s"]
    assert here.death_time == there.death_time == D
    assert here.failure == there.failure and here.failure is not None
    brief = view.read_remote(connection.Local(), str(tmp_path / "loop"), False, timeout=10)
    assert brief.samples is None and brief.history == here.history
    # A ring of megabytes (a chatty server log): its end only crosses, the status still does.
    ring = tmp_path / "loop" / ".ralph" / "recorder"
    chatty = json.dumps({"t": time.time(), "log": "INFO: " + "x" * 200}) + "\n"
    last = {"t": time.time(), "sample": {"metrics": {view.GENERATED: 1.0}}}
    (ring / "segment-00000002.jsonl").write_text(chatty * 10_000 + json.dumps(last) + "\n")
    big = view.read_remote(connection.Local(), str(tmp_path / "loop"), True, timeout=10)
    assert big.status == here.status and big.samples is not None and big.samples[-1] == last
    assert big.log == ["INFO: " + "x" * 200] * view.LOG_LINES
    missing = view.read_remote(connection.Local(), str(tmp_path / "none"), True, timeout=10)
    assert missing.reachable and missing.status is None and "no status" in missing.error
    assert "no status" in view.read_local(str(tmp_path / "none"), True).error


def screen(board: top.View, height: int = 24) -> list[str]:
    console = Console(width=80, height=height, file=io.StringIO(), color_system=None)
    console.print(board.render(80, height))
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue().splitlines()


class HungStatus:
    """A loop's status.json that hangs its reader: a FIFO that no one writes (a reader hangs in
    its open, as on a stuck file system). `set()` answers the reader in flight with the status
    and puts the status back as a file; `clear()` makes it a FIFO again: the next read hangs."""

    def __init__(self, path: Path) -> None:
        self.path, self.text = path, path.read_text()
        self.hung = False
        self.clear()

    def clear(self) -> None:
        fifo = self.path.with_suffix(".fifo")
        os.mkfifo(fifo)
        fifo.replace(self.path)  # at once: a read meanwhile finds the file, or the FIFO
        self.hung = True

    def set(self) -> None:
        if not self.hung:
            return
        try:  # the reader in flight, if any, gets the status
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader in flight
            pass
        else:
            try:
                os.write(fd, self.text.encode())
            finally:
                os.close(fd)
        file = self.path.with_suffix(".tmp")
        file.write_text(self.text)
        file.replace(self.path)  # the FIFO's reader, if any, still reads what was written
        self.hung = False


def test_a_loop_whose_read_hangs_holds_up_no_other_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slow loop's status.json is a FIFO that no one writes: ralph-run's own read of it
    (top_view.read_local) hangs, until the test answers it."""
    for name in ("fast", "slow"):
        write_workdir(tmp_path / name)
    release = HungStatus(tmp_path / "slow" / ".ralph" / "status.json")
    loops = [top.Loop("localhost", str(tmp_path / n), None, n) for n in ("fast", "slow")]
    monkeypatch.setattr(top, "STALE", 2.0)
    with top.ThreadPoolExecutor(4) as pool:
        try:
            hung_reads_hold_up_nothing(top.View(loops, pool, timeout=5), release)
        finally:
            release.set()  # the pool's end waits for its threads: the hung read is answered


def hung_reads_hold_up_nothing(board: top.View, release: HungStatus) -> None:
    started = time.monotonic()
    board._settle(board.poll())
    assert time.monotonic() - started < 2  # the grace, not the hung read
    lines = screen(board)
    assert "finished" in next(x for x in lines if x.startswith(">fast"))
    assert "reading..." in next(x for x in lines if x.startswith(" slow"))
    assert len(lines) <= 24 and all(len(x) <= 80 for x in lines)
    assert "it  outcome  time  tokens p/g  commit" in "\n".join(lines)
    assert any("12.0k/300" in x and "0123456" in x and "+4 -1" in x for x in lines)
    assert any("tok/s" in x and "▂▄▆█ " in x and x.rstrip().endswith("-") for x in lines)
    assert any("last failed attempt's output (b)" in x for x in lines)
    assert any("try again" in x for x in lines)

    def slow_row() -> str:
        board.poll()  # the hung read is not asked for again: one in flight per loop
        return next(x for x in screen(board) if x.startswith(" slow"))

    wait_for(lambda: "no answer" in slow_row(), 10, "the hung loop to say no answer")
    release.set()
    wait_for(lambda: "finished" in slow_row(), 10, "the answer once it comes")
    release.clear()  # it hangs again: its last known row stays, marked
    wait_for(lambda: "no answer" in slow_row() and " 4 " in slow_row(), 10, "stale row")


def test_many_loops_fit_in_80x24_scrolled_to_the_selection(tmp_path: Path) -> None:
    loops = []
    for n in range(15):
        write_workdir(tmp_path / f"loop-{n}")
        loops.append(top.Loop("localhost", str(tmp_path / f"loop-{n}"), None, f"loop-{n}"))
    loops.append(top.Loop("remote", "/srv", None, "remote", error="no such host"))
    with top.ThreadPoolExecutor(4) as pool:
        board = top.View(loops, pool, timeout=5)
        board.selected = 15
        for _ in range(2):  # the second round: the selected loop read with its details
            top.concurrent.futures.wait(board.poll())
        lines = screen(board)
        assert len(lines) <= 24 and all(len(x) <= 80 for x in lines), "\n".join(lines)
        assert lines[-1].startswith("up/down j/k select")
        assert any(x.startswith(">remote") and "unreachable" in x for x in lines)
        assert "16 loop(s), 4-16 shown" in lines[0]
        assert not any(x.startswith(" loop-2 ") for x in lines)
        board.selected = 0
        assert any(x.startswith(">loop-0 ") for x in screen(board))
        tall = screen(board, height=40)
        assert "shown" not in tall[0] and any(x.startswith(" remote ") for x in tall)


def test_workers_show_in_the_row_and_each_ones_item_in_the_details() -> None:
    workers = [
        {"worker": 1, "item": "fix the parser", "phase": "run the agent"},
        {"worker": 2, "item": None, "phase": None},
        {"worker": 3, "item": "add a test", "phase": "landing"},
    ]
    governor = {"workers": 3, "max_workers": 8, "reason": "2 requests waiting", "changed": D}
    status = death_row(item=None, workers=workers, governor=governor)
    reading = view.LoopReading(status=status, wall=D)
    row = view.cells(reading, D + 1)
    assert row[2] == "2/3 workers: fix the parser, add a test"
    text = [str(line) for line in view.worker_lines(status)]
    assert text == [
        "  governor: 3 of 8 workers (2 requests waiting)",
        "  worker 1: fix the parser  (run the agent)",
        "  worker 2: idle",
        "  worker 3: add a test  (landing)",
    ]
    shown = io.StringIO()
    Console(file=shown, width=100).print(*view.details("loop", reading, None, 100, None))
    assert "worker 3: add a test" in shown.getvalue()
    assert view.worker_lines({**status, "running": False}) == []


def test_rejuvenations_show_beside_the_deaths_as_a_count_of_their_own() -> None:
    """health.rejuvenate's restarts are no deaths: the deaths cell keeps its count, ♻N after."""
    rejuvenation = {"count": 2, "by_sign": {"decode_drop": 2}, "due": None, "last": None}
    row = view.cells(view.LoopReading(status=death_row(rejuvenation=rejuvenation), wall=D), D)
    assert row[5] == "1 ♻2"
    assert view.cells(view.LoopReading(status=death_row(), wall=D), D)[5] == "1"
