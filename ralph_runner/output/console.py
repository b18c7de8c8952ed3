"""What the operator sees of the events: readable lines (coloured on a terminal, as rich finds
it: `NO_COLOR` turns colour off, `FORCE_COLOR` on, a pipe or a file gets none) or, with
`--json`, one JSON line per event. Every line is written by `Console.write`, which survives a
reader that left."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

import rich.console
from rich.console import COLOR_SYSTEMS
from rich.style import Style

from ralph_runner import events
from ralph_runner.output import durations
from ralph_runner.output.lines import human_line
from ralph_runner.output.text import printable

STYLES = {name: Style.parse(name) for name in ("red", "green", "yellow", "cyan", "dim", "bold")}


class Console:
    """What the operator sees of the events: readable lines (coloured on a terminal, `-v` adds
    the steps and their output) or, with `--json`, one JSON line per event."""

    def __init__(
        self, *, json_lines: bool = False, stream: IO[str] | None = None, verbose: int = 0
    ) -> None:
        self.json_lines, self.verbose = json_lines, verbose
        self.stream = stream or sys.stdout
        # rich reads the terminal and the environment: NO_COLOR, FORCE_COLOR, TERM=dumb
        self.terminal = rich.console.Console(file=self.stream, highlight=False)
        self.colour = (
            not json_lines
            and self.terminal.is_terminal
            and not self.terminal.no_color
            and self.terminal.color_system is not None
        )
        self.colours = COLOR_SYSTEMS.get(self.terminal.color_system or "")
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._ticker: _Ticker | None = None
        self.detached = False  # the stream could not be written: nothing is shown any more

    def on_event(self, event: events.Event) -> None:
        kind, fields = event.kind, event.json_fields()
        if self.colour and isinstance(event, events.Step | events.StepDone):
            self._tick(event.step if isinstance(event, events.Step) else None)
        with self._lock:
            if self.json_lines:
                line = json.dumps(
                    {"event": kind, "time": round(time.time(), 3), **fields},
                    ensure_ascii=False,
                    default=str,
                )
            else:
                shown = human_line(_items_printable(event), self._paint, self.verbose)
                if shown is None:
                    return
                line = shown
                if event.host is not None:  # a fleet run: every line says whose it is
                    line = self._paint("cyan", f"[{event.host}]") + " " + line
                elapsed = time.monotonic() - self._started
                line = self._paint("dim", f"[{durations.clock(elapsed)}]") + " " + line
                if self.colour:
                    line = "\r\033[K" + line  # over the ticker's line, if one is drawn
            self.write(line + "\n")

    def write(self, text: str) -> None:
        """`text` to the stream (under the lock). A stream that cannot be written any more (a
        closed pipe, `ralph-run ... | head -3`; a terminal hung up, a dropped ssh or tmux
        session) detaches the console: the run goes on and says nothing more here (its status,
        history and death log keep what it does). The stream's descriptor then points at
        /dev/null, so nothing else that writes to it (a flush at exit) fails either."""
        if self.detached:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:  # EPIPE: the reader left; EIO: the terminal is gone
            self.detached = True
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def _tick(self, step: str | None) -> None:
        """On a terminal, a live line under the log: the running step and its elapsed time."""
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        if step is not None:
            self._ticker = _Ticker(self.write, self._lock, self._paint("cyan", f"  … {step}"))

    def _paint(self, colour: str, text: str) -> str:
        if not self.colour:
            return text
        return STYLES[colour].render(text, color_system=self.colours)


class _Ticker:
    """Redraws one status line every second until stopped, then erases it."""

    def __init__(self, write: Callable[[str], None], lock: threading.Lock, label: str) -> None:
        self.write, self.lock, self.label = write, lock, label
        self.started = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ticker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(1.0):
            with self.lock:
                seconds = time.monotonic() - self.started
                self.write(f"\r\033[K{self.label} {durations.clock(seconds)}")

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        with self.lock:
            self.write("\r\033[K")


def _items_printable(event: events.Event) -> events.Event:
    """`event` with its checklist items (text from a file) made printable for the console."""
    found: dict[str, object] = {
        name: printable(value)
        for name in ("item", "previous_item")
        if isinstance(value := getattr(event, name, None), str)
    }
    if isinstance(skipped := getattr(event, "skipped", None), list):
        found["skipped"] = [printable(str(item)) for item in skipped]
    return events.masked(event, found) if found else event
