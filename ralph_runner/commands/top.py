"""`ralph-run top [WORKDIR|RUNBOOK... | -i INVENTORY [--limit P]]`: the loops, live.

A full-screen view (Rich's `Live`, on the terminal's alternate screen) redrawn every second from
what the loops already write under `.ralph/` (top_view.py reads and draws it): one row per
loop, and the selected loop's engine sparklines, last iterations with their receipts and last
output. Read here for workdirs on this machine, over each host's connection with `-i`.

Every loop is read in the background, at most one read in flight per loop, so a host that does
not answer holds up nothing: each redraw shows the latest answer of every loop, and a loop whose
read has been out for more than STALE seconds shows its last known row as "no answer Ns" (one
never read yet: "reading..."). Keys: up/down or j/k select a loop, p pauses it, r resumes it,
o writes its HTML report, q quits; they are read from the terminal in cbreak mode by a thread,
and what they do (over ssh too) runs in the background as well. When stdout is no terminal
(`ralph-run top | cat`), or with `--once`, it prints one plain-text snapshot, no escape codes,
after every read has answered or timed out, and exits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import queue
import select
import shutil
import subprocess
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from ralph_runner import crash
from ralph_runner.commands import options, status
from ralph_runner.commands import top_view as view
from ralph_runner.errors import FatalError, Problem
from ralph_runner.fleet import control
from ralph_runner.fleet import status as fleet_status
from ralph_runner.loop import pause
from ralph_runner.output import durations
from ralph_runner.process import connection, execute
from ralph_runner.runbook import inventory
from ralph_runner.workspace.state_files import STATE_DIR

REFRESH = 1.0  # seconds between redraws
STALE = 2.5 * REFRESH  # a read out longer than this: the row says "no answer"
GRACE = 0.25  # seconds a redraw waits for the reads it just asked for (a local one takes ms)
REPORT = "report.html"  # written into the loop's .ralph/ by the key o
REPORT_TIMEOUT = 300.0  # seconds for `ralph-run report` to write it
HELP = "up/down j/k select   p pause   r resume   o report   q quit"
KEYS = {"\x1b[A": "up", "\x1bOA": "up", "\x1b[B": "down", "\x1bOB": "down"}
KEYS.update({"k": "up", "j": "down", "p": "pause", "r": "resume", "o": "report"})
KEYS.update({"q": "quit", "Q": "quit"})


@dataclass
class Loop:
    host: str
    workdir: str
    conn: connection.Connection | None  # None: a workdir on this machine, read directly
    label: str
    error: str | None = None  # the host's connection could not be made


@dataclass
class LoopReads:
    """What is known of one loop: its last answer, and the read in flight."""

    last: view.LoopReading | None = None  # the last read that got an answer
    detailed: view.LoopReading | None = None  # the last one that read the details too
    failed: view.LoopReading | None = None  # the last read, when it got no answer
    asked: float | None = None  # monotonic time the read in flight began; None: none is
    first: float | None = None  # monotonic time of the first read


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run top`'s options."""
    parser.add_argument(
        "targets",
        nargs="*",
        help="workdirs or runbooks (default: .; with -i: a directory template or runbook)",
    )
    options.each_host(parser, inventory_help="every host's loop, over its connection", timeout=5.0)
    parser.add_argument("--once", action="store_true", help="print one plain snapshot and exit")


def main(args: argparse.Namespace) -> int:
    loops = loops_of(args)
    with ThreadPoolExecutor(max_workers=max(1, min(64, len(loops)))) as pool:
        screen = View(loops, pool, args.timeout)
        if args.once or not (sys.stdout.isatty() and sys.stdin.isatty()):
            width = int(os.environ.get("COLUMNS") or 100)
            console = Console(color_system=None, force_terminal=False, highlight=False, width=width)
            concurrent.futures.wait(screen.poll())
            console.print(screen.render(width, None, plain=True))
            return 0
        try:
            return screen.live()
        finally:  # q quits now, not after the reads that wait on a host that does not answer
            pool.shutdown(wait=False, cancel_futures=True)
            execute.kill_all(grace=0.5)


def loops_of(args: argparse.Namespace) -> list[Loop]:
    """The loops to watch: workdirs here, or every host's of an inventory."""
    if not args.inventory:
        workdirs = [status.workdir_of(t) for t in args.targets or ["."]]
        for target, place in zip(args.targets or ["."], workdirs, strict=True):
            if not place.is_dir():  # a typo is no loop that "never ran here" (exit 2)
                raise FatalError(Problem("no such workdir", target))
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
        if isinstance(conn, connection.Local):  # its files are here: read them directly
            loops.append(Loop(host, str(Path(workdir).expanduser().resolve()), None, host))
        else:
            loops.append(Loop(host, workdir, conn, host))
    return loops


class View:
    """The loops' latest answers, the selection and the keys' actions; drawn by top_view."""

    def __init__(self, loops: list[Loop], pool: ThreadPoolExecutor, timeout: float) -> None:
        self.loops, self.pool, self.timeout = loops, pool, timeout
        self.reads = [LoopReads() for _ in loops]
        self.selected = 0
        self.message = ""
        self.lock = threading.Lock()

    # -- reading, in the background -------------------------------------------------
    def poll(self, only: int | None = None) -> list[Future[None]]:
        """Ask every loop (or one) that has no read in flight for a new one."""
        asked = []
        now = time.monotonic()
        for index, reads in enumerate(self.reads):
            if only is not None and index != only:
                continue
            with self.lock:
                if reads.asked is not None:
                    continue
                reads.asked = now
                reads.first = reads.first or now
            asked.append(self.pool.submit(self._fetch, index, index == self.selected))
        return asked

    def _fetch(self, index: int, detailed: bool) -> None:
        loop, reads = self.loops[index], self.reads[index]
        try:
            found = self._read(loop, detailed)
        except Exception as exc:  # a bug here must show in the row, not stop the reads
            found = view.LoopReading.unread(f"read failed: {exc!r}", reachable=False)
        with self.lock:
            reads.asked = None
            if found.reachable:
                reads.last, reads.failed = found, None
                if detailed:
                    reads.detailed = found
            else:
                reads.failed = found

    def _read(self, loop: Loop, detailed: bool) -> view.LoopReading:
        if loop.error:
            return view.LoopReading.unread(loop.error, reachable=False)
        if loop.conn is not None:
            return view.read_remote(loop.conn, loop.workdir, detailed, self.timeout)
        return view.read_local(loop.workdir, detailed)

    def _settle(self, asked: list[Future[None]]) -> None:
        """Give the reads just asked for a moment (local ones take milliseconds)."""
        concurrent.futures.wait(asked, timeout=GRACE)

    # -- drawing --------------------------------------------------------------------
    def render(self, width: int, height: int | None, plain: bool = False) -> RenderableType:
        """The screen; `height` None: no limit (the plain snapshot)."""
        now, wall = time.monotonic(), time.time()
        with self.lock:
            known = [(w.last or w.failed, w.detailed, self._stale(w, now)) for w in self.reads]
        room = len(self.loops) if height is None else max(1, height - 11)
        first = min(max(0, self.selected - room + 1), max(0, len(self.loops) - room))
        shown = range(first, min(len(self.loops), first + room))
        rows = []
        for index in shown:
            last, _, stale = known[index]
            reading = last or view.LoopReading.unread("", reachable=False)
            selected = index == self.selected
            style = "reverse" if selected else "dim" if stale else None
            mark = ">" if selected else " "
            rows.append((mark + self.loops[index].label, view.cells(reading, wall, stale), style))
        if plain:
            rows = [(name, cells, None) for name, cells, _ in rows]
        heading = f"ralph-run top  {time.strftime('%H:%M:%S')}  {len(self.loops)} loop(s)"
        if len(shown) < len(self.loops):
            heading += f", {shown.start + 1}-{shown.stop} shown"
        loop = self.loops[self.selected]
        last, detailed, stale = known[self.selected]
        death = view.last_death_text(last.status) if last and last.status else ""
        title = loop.label + (f" [{stale}]" if stale else "") + (f": {death}" if death else "")
        title += f"  ({loop.host}:{loop.workdir})"
        budget = None if height is None else height - 3 - len(rows) - (0 if plain else 2)
        parts: list[RenderableType] = [Text(heading), view.table(rows)]
        parts += view.details(title, last, detailed, width, budget)
        if not plain:
            parts.append(Text(self.message, no_wrap=True, overflow="ellipsis"))
            parts.append(Text(HELP))
        return Group(*parts)

    @staticmethod
    def _stale(reads: LoopReads, now: float) -> str | None:
        """ "no answer Ns" (since its last answer) for a loop whose read is out too long or got
        no answer; "reading..." for one not read yet; None when it is fresh."""
        late = reads.asked is not None and now - reads.asked > STALE
        if reads.last is not None and (late or reads.failed):
            return f"no answer {durations.cell(time.time() - reads.last.wall)}"
        if reads.last is None and reads.failed is None:
            return (
                f"no answer {durations.cell(now - (reads.first or now))}" if late else "reading..."
            )
        return None  # fresh, or never answered and its error says why

    # -- the live screen ------------------------------------------------------------
    def live(self) -> int:
        console = Console()
        with _keys() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
            tick = 0.0
            while True:
                if time.monotonic() >= tick:
                    tick = time.monotonic() + REFRESH
                    self._settle(self.poll())
                size = console.size
                live.update(self.render(size.width, size.height), refresh=True)
                try:
                    key = keys.get(timeout=max(0.0, tick - time.monotonic()))
                except queue.Empty:
                    continue
                if key == "quit":
                    return 0
                self._on_key(key)

    def _on_key(self, key: str) -> None:
        if key in ("up", "down"):
            step = -1 if key == "up" else 1
            self.selected = min(len(self.loops) - 1, max(0, self.selected + step))
            self._settle(self.poll(self.selected))  # its details, if no read is out
        elif key in ("pause", "resume", "report"):
            loop = self.loops[self.selected]
            what = self._report if key == "report" else lambda at: self._control(at, key)
            self.message = f"{loop.label}: {'writing the report' if key == 'report' else key}..."
            doing = threading.Thread(target=self._tell, args=(loop, what), daemon=True)
            doing.start()  # a thread of its own: the reads' pool stays theirs
            doing.join(GRACE)

    def _tell(self, loop: Loop, action: Callable[[Loop], str]) -> None:
        try:
            said = action(loop)
        except Exception as exc:  # the screen goes on; the message says what went wrong
            said = f"error: {exc}"
        self.message = f"{loop.label}: {said}"

    def _control(self, loop: Loop, action: str) -> str:
        if loop.error:
            return f"error: {loop.error}"
        if loop.conn is not None:
            row = control.send_one(loop.host, loop.conn, loop.workdir, action, False, self.timeout)
            return row.get("said") or f"error: {row.get('error')}"
        try:
            if action == "pause":
                if pause.read(pause.control_path(Path(loop.workdir))) is not None:
                    return "already paused (or pausing): r resumes"  # the request is kept
                pause.request(Path(loop.workdir))
                return "pause asked for: it waits after the iteration in hand"
            return "resumed" if pause.release(Path(loop.workdir)) else "not paused"
        except FatalError as exc:
            return f"error: {exc.problems[0]}"

    def _report(self, loop: Loop) -> str:
        """The loop's deaths as `ralph-run report` writes them, into its .ralph/, by that
        command in a process of its own (rendering the page would hold up the reads): run here
        and opened (xdg-open, with a DISPLAY) for a local loop; run on the host, where the
        records are, for a remote one, whose path on the host is shown."""
        if loop.error:
            return f"error: {loop.error}"
        relative = f"{STATE_DIR}/{REPORT}"
        if loop.conn is not None:
            command = (
                f"cd {connection.remote_path(loop.workdir)} &&"
                " if command -v ralph-run >/dev/null 2>&1;"
                f" then ralph-run report . -o {relative}; else python3 -m ralph_runner report ."
                f" -o {relative}; fi"
            )
            result = loop.conn.shell(command, timeout=REPORT_TIMEOUT)
            lines = result.output.strip().splitlines()
            if result.exit_code != 0:
                return report_failed(result.output, result.exit_code, loop.host)
            return f"report on {loop.host}: {loop.workdir.rstrip('/')}/{relative} (copy it: scp)"
        output = Path(loop.workdir) / relative
        shown = os.path.relpath(output)
        shown = str(output) if shown.startswith("..") else shown
        argv = [sys.executable, "-m", "ralph_runner", "report", loop.workdir, "-o", shown]
        result = execute.run(argv, timeout=REPORT_TIMEOUT)
        lines = result.output.strip().splitlines()
        if result.exit_code != 0:
            return report_failed(result.output, result.exit_code)
        if os.environ.get("DISPLAY") and shutil.which("xdg-open"):
            subprocess.Popen(
                ["xdg-open", str(output)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            return f"{lines[-1]}, opening it"
        return lines[-1]  # report: PATH (N deaths, M iterations, S MB)


def report_failed(output: str, code: int | None, host: str | None = None) -> str:
    """A failed `ralph-run report` in one line: its error, or, when it crashed (a bug), the crash
    file to report it with first, then the cause (crash.py writes those lines; the last one,
    "please report it with that file", names none)."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    on = f" on {host}" if host else ""
    said = {
        says: line[len(says) :]
        for says in (crash.SAYS_CAUSE, crash.SAYS_FILE)
        for line in lines
        if line.startswith(says)
    }
    cause, crash_file = said.get(crash.SAYS_CAUSE), said.get(crash.SAYS_FILE)
    if crash_file:
        where = f"{host}:{crash_file}" if host else crash_file
        return f"report failed{on}, a bug in ralph-run: please report it with {where} ({cause})"
    if cause:  # no crash file could be written: the traceback went to its stderr
        return f"report failed{on}, a bug in ralph-run (no crash file written): {cause}"
    return f"report failed{on}: {lines[-1] if lines else code}"


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
