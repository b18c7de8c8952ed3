"""`ralph-run top [WORKDIR|RUNBOOK... | -i INVENTORY [--limit P]]`: the loops, live.

A full-screen view (Rich's `Live`, on the terminal's alternate screen) redrawn every second from
what the loops already write: `.ralph/status.json` (state, iteration, item, step, deaths, the
last death's fault, the checklist's counts, the pause) and `.ralph/iterations.jsonl` (the
selected loop's last iterations). Read here for workdirs on this machine, over each host's
connection with `-i` (as `status -i`, each read within `--timeout`). Keys: up/down or j/k
select a loop, p pauses it, r resumes it, q quits. The keys are read from the terminal in
cbreak mode by a thread. When stdout is no terminal (`ralph-run top | cat`), or with `--once`,
it prints one plain-text snapshot, no escape codes, and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import select
import shlex
import sys
import termios
import threading
import time
import tty
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ralph_runner.commands import status
from ralph_runner.errors import FatalError
from ralph_runner.fleet import control
from ralph_runner.fleet import status as fleet_status
from ralph_runner.loop import pause, state
from ralph_runner.process import connection
from ralph_runner.runbook import inventory

REFRESH = 1.0  # seconds between redraws
HISTORY_LINES = 6  # the selected loop's last iterations
TAIL_BYTES = 64 * 1024  # what is read of a local iterations.jsonl: its end only
KEYS = {"\x1b[A": "up", "\x1bOA": "up", "\x1b[B": "down", "\x1bOB": "down"}
KEYS.update({"k": "up", "j": "down", "p": "pause", "r": "resume", "q": "quit", "Q": "quit"})


@dataclass
class Loop:
    host: str
    workdir: str
    conn: connection.Connection | None  # None: a workdir on this machine, read directly
    label: str
    error: str | None = None  # the host's connection could not be made


def main(args: argparse.Namespace) -> int:
    loops = loops_of(args)
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(loops)))) as pool:
        view = View(loops, pool, args.timeout)
        if args.once or not (sys.stdout.isatty() and sys.stdin.isatty()):
            width = int(os.environ.get("COLUMNS") or 100)
            console = Console(color_system=None, force_terminal=False, highlight=False, width=width)
            console.print(view.render(view.gather(), plain=True))
            return 0
        return view.live()


def loops_of(args: argparse.Namespace) -> list[Loop]:
    """The loops to watch: workdirs here, or every host's of an inventory."""
    if not args.inventory:
        workdirs = [status.workdir_of(t) for t in args.targets or ["."]]
        return [Loop("localhost", str(w), None, w.name or str(w)) for w in workdirs]
    if len(args.targets) > 1:
        raise FatalError("with -i, give at most one runbook or directory template")
    target = args.targets[0] if args.targets else None
    places = fleet_status.workdirs(target, args.inventory, args.limit)
    inv = inventory.load(args.inventory)
    loops = []
    for host, workdir in places.items():
        try:
            conn: connection.Connection | None = connection.for_host(
                {**inv.host_vars(host), "inventory_hostname": host}
            )
        except FatalError as exc:
            loops.append(Loop(host, workdir, None, host, error=str(exc.problems[0])))
            continue
        loops.append(Loop(host, workdir, conn, host))
    return loops


class View:
    """The rows, the selection and the keys' actions; rendered by Rich."""

    def __init__(self, loops: list[Loop], pool: ThreadPoolExecutor, timeout: float) -> None:
        self.loops, self.pool, self.timeout = loops, pool, timeout
        self.selected = 0
        self.message = ""

    # -- reading ------------------------------------------------------------------
    def gather(self) -> list[dict[str, Any]]:
        rows = list(self.pool.map(self._read, self.loops))
        rows[self.selected]["history"] = self._history(self.loops[self.selected])
        return rows

    def _read(self, loop: Loop) -> dict[str, Any]:
        if loop.error:
            return {"error": loop.error, "reachable": False}
        if loop.conn is not None:
            return fleet_status.read_one(loop.host, loop.conn, loop.workdir, self.timeout)
        try:
            found = state.Store(Path(loop.workdir)).read_status()
        except FatalError as exc:
            return {"error": str(exc.problems[0]), "reachable": True}
        if found is None:
            return {"error": "no status (never run here?)", "reachable": True}
        found["running"] = bool(found.get("running")) and status._alive(found.get("pid"))
        return found

    def _history(self, loop: Loop) -> list[dict[str, Any]]:
        path = f"{loop.workdir.rstrip('/')}/{state.STATE_DIR}/{state.HISTORY_FILE}"
        if loop.error:
            return []
        if loop.conn is not None:
            quoted = path if path.startswith("~/") else shlex.quote(path)
            result = loop.conn.shell(f"tail -n {HISTORY_LINES} {quoted}", timeout=self.timeout)
            text = result.output if result.exit_code == 0 else ""
        else:
            try:
                with open(path, "rb") as file:
                    file.seek(max(0, os.fstat(file.fileno()).st_size - TAIL_BYTES))
                    text = file.read().decode("utf-8", "replace")
            except OSError:
                text = ""
        lines = []
        for line in text.splitlines()[-HISTORY_LINES:]:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    lines.append(entry)
        return lines

    # -- drawing ------------------------------------------------------------------
    def render(self, rows: list[dict[str, Any]], plain: bool = False) -> RenderableType:
        table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False)
        table.add_column("loop", no_wrap=True, max_width=14, overflow="ellipsis")
        table.add_column("state", no_wrap=True)
        table.add_column("it", justify="right", no_wrap=True)
        table.add_column("item (attempt)", no_wrap=True, overflow="ellipsis", ratio=1)
        table.add_column("step", justify="right", no_wrap=True)
        table.add_column("deaths", no_wrap=True, max_width=16, overflow="ellipsis")
        table.add_column("d/t/s", no_wrap=True)
        now = time.time()
        for index, (loop, row) in enumerate(zip(self.loops, rows, strict=True)):
            mark = ">" if index == self.selected else " "
            style = "reverse" if index == self.selected and not plain else None
            table.add_row(mark + loop.label, *_cells(row, now), style=style)
        selected = self.loops[self.selected]
        parts: list[RenderableType] = [
            Text(f"ralph-run top  {time.strftime('%H:%M:%S')}  {len(self.loops)} loop(s)"),
            table,
            Text(
                f"{selected.label}, last iterations ({selected.host}:{selected.workdir})",
                overflow="ellipsis",
                no_wrap=True,
            ),
            _iterations(rows[self.selected].get("history") or []),
        ]
        if not plain:
            parts.append(Text(self.message, overflow="ellipsis", no_wrap=True))
            parts.append(Text("up/down j/k select   p pause   r resume   q quit"))
        return Group(*parts)

    # -- the live screen ----------------------------------------------------------
    def live(self) -> int:
        console = Console()
        with _keys() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                live.update(self.render(self.gather()), refresh=True)
                try:
                    key = keys.get(timeout=REFRESH)
                except queue.Empty:
                    continue
                if key == "quit":
                    return 0
                self._on_key(key)

    def _on_key(self, key: str) -> None:
        if key == "up":
            self.selected = max(0, self.selected - 1)
        elif key == "down":
            self.selected = min(len(self.loops) - 1, self.selected + 1)
        elif key in ("pause", "resume"):
            loop = self.loops[self.selected]
            self.message = f"{loop.label}: {self._control(loop, key)}"

    def _control(self, loop: Loop, action: str) -> str:
        if loop.error:
            return f"error: {loop.error}"
        if loop.conn is not None:
            row = control.send_one(loop.host, loop.conn, loop.workdir, action, False, self.timeout)
            return row.get("said") or f"error: {row.get('error')}"
        try:
            if action == "pause":
                pause.request(Path(loop.workdir))
                return "pause asked for: it waits after the iteration in hand"
            return "resumed" if pause.release(Path(loop.workdir)) else "not paused"
        except FatalError as exc:
            return f"error: {exc.problems[0]}"


def _cells(row: dict[str, Any], now: float) -> list[str]:
    if "error" in row:
        what = "unreachable" if not row.get("reachable") else "no status"
        return [what, "", row["error"], "", "", ""]
    paused = row.get("pause") or {}
    if row.get("running"):
        state_text = "paused" if row.get("paused") else paused.get("state") or "running"
    elif row.get("status") == "running":
        state_text = "dead"
    else:
        state_text = str(row.get("status", "?"))
    item = row.get("item") or ""
    if item:
        item += f" ({row.get('attempts', 0) + 1})"
    since = paused.get("since") if row.get("paused") else row.get("step_started")
    step = _duration(now - since) if row.get("running") and isinstance(since, int | float) else ""
    last = row.get("last_death") or {}
    deaths = str(row.get("deaths", 0))
    if last.get("fault") or last.get("phase"):
        deaths += f" {last.get('fault') or last.get('phase')}"
    counts = f"{row.get('done', 0)}/{row.get('todo', 0)}/{row.get('skipped', 0)}"
    return [state_text, str(row.get("iteration", 0)), item, step, deaths, counts]


def _iterations(lines: list[dict[str, Any]]) -> RenderableType:
    if not lines:
        return Text("  no iteration finished yet")
    table = Table(box=None, pad_edge=False, show_header=True, expand=True)
    table.add_column("it", justify="right", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("deaths", justify="right", no_wrap=True)
    table.add_column("item", no_wrap=True, overflow="ellipsis", ratio=1)
    for line in lines:
        seconds = line.get("seconds")
        table.add_row(
            str(line.get("iteration", "")),
            str(line.get("outcome", "")),
            _duration(seconds) if isinstance(seconds, int | float) else "",
            str(len(line.get("deaths") or [])),
            str(line.get("item", "")),
        )
    return table


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@contextlib.contextmanager
def _keys() -> Iterator[queue.Queue[str]]:
    """The keys pressed, as names, read by a thread from the terminal in cbreak mode."""
    keys: queue.Queue[str] = queue.Queue()
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            data = os.read(fd, 32).decode("utf-8", "replace")
            if not data:
                keys.put("quit")  # the terminal went away
                return
            while data:
                for sequence, name in KEYS.items():
                    if data.startswith(sequence) and len(sequence) > 1:
                        keys.put(name)
                        data = data[len(sequence) :]
                        break
                else:
                    name = KEYS.get(data[0], "")
                    if name:
                        keys.put(name)
                    data = data[3:] if data.startswith("\x1b[") else data[1:]

    tty.setcbreak(fd)
    reader = threading.Thread(target=read, name="keys", daemon=True)
    reader.start()
    try:
        yield keys
    finally:
        done.set()
        reader.join(1)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
