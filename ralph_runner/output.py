"""The run's event bus, and what the operator sees of it: readable lines (coloured on a
terminal) or one JSON event per line; the one style of text for people."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Protocol

from ralph_runner import events
from ralph_runner.durable.redaction import Redactor

COLOURS = {"red": "31", "green": "32", "yellow": "33", "cyan": "36", "dim": "2", "bold": "1"}


class Follower(Protocol):
    """Follows the run's events (the history, the metrics textfile, the notifier, the pause
    control, the console), each by the event's class."""

    def on_event(self, event: events.Event) -> None: ...


class Console:
    """What the operator sees of the events: readable lines (coloured on a terminal, `-v` adds
    the steps and their output) or, with `--json`, one JSON line per event."""

    def __init__(
        self, *, json_lines: bool = False, stream: IO[str] | None = None, verbose: int = 0
    ) -> None:
        self.json_lines, self.verbose = json_lines, verbose
        self.stream = stream or sys.stdout
        self.colour = not json_lines and self.stream.isatty()
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
                line = self._paint("dim", f"[{_clock(elapsed)}]") + " " + line
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
        return f"\033[{COLOURS[colour]}m{text}\033[0m" if self.colour else text


class EventBus:
    """`emit(event)` is the one way the run reports; thread-safe. Every follower, the console
    last, sees the event with its secrets masked."""

    def __init__(self, console: Console, redactor: Redactor | None = None) -> None:
        self.console = console
        self.redactor = redactor or Redactor([])
        self._followers: list[Follower] = []
        # one event at a time: workers' threads emit too, and followers (the history) append
        self._emitting = threading.RLock()

    @property
    def verbose(self) -> int:
        return self.console.verbose

    def follow(self, follower: Follower) -> None:
        """Also hand every event to `follower`: the iteration history, the metrics textfile and
        notifications follow the loop this way, not by hooks in it. A follower that raises is
        reported once as a warning and dropped; the loop goes on."""
        self._followers.append(follower)

    def emit(self, event: events.Event) -> None:
        event = events.masked(event, self.redactor.data(event.json_fields()))
        with self._emitting:
            for follower in list(self._followers):
                try:
                    follower.on_event(event)
                except Exception as exc:  # a broken follower must never stop the loop
                    self._followers.remove(follower)
                    self.warn(f"event listener {follower!r} failed: {exc}")
            self.console.on_event(event)

    def warn(self, message: str) -> None:
        self.emit(events.Warning(message=message))


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
                self.write(f"\r\033[K{self.label} {_clock(seconds)}")

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


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}"


Painter = Callable[[str, str], str]
STRIKE_TAIL_LINES = 5  # the agent's last words under a strike; the whole tail is in --json


def human_line(event: events.Event, p: Painter, verbose: int = 1) -> str | None:
    """The console's line for `event` (`p` paints a colour); None when it has none: a `Step`
    below -v, an `IterationEnded` (done, retry, strike, skip... said it to people), a kind this
    ralph-run does not know."""
    e = event
    match e:
        case events.Resume():
            return p("yellow", f"resuming at iteration {e.iteration} ({e.deaths} deaths so far)")
        case events.Iteration():
            return p("bold", f"iteration {e.iteration}: {e.item}") + p(
                "dim",
                f"  (strikes {e.attempts}, prompt {e.prompt_size} chars; {e.done} done, "
                f"{e.todo} todo, {e.skipped} skipped, {e.deaths} deaths)",
            )
        case events.Step():
            whose = f"[{e.worker}] " if e.worker is not None else ""
            return f"  → {whose}{e.step}" if verbose else None
        case events.StepDone():
            mark = p("green", "✓") if e.ok else p("red", "✗")
            failed = "" if e.ok else " " + p("red", _step_status(e))
            whose = f"[{e.worker}] " if e.worker is not None else ""
            return f"  {mark} {whose}{e.step} " + p("dim", f"{e.seconds:.1f}s") + failed
        case events.Watch():
            return p("red", f"  ! service died during {e.step}: step killed")
        case events.Death():
            cause = f"{e.fault} ({e.reason})" if e.fault else e.reason
            return p("red", f"💀 death #{e.death} at {e.phase}: {cause}")
        case events.Capture():
            line = f"  capturing {e.collectors} diagnostics"
            if e.during_recovery:
                line += (
                    f" (while {e.during_recovery} recovers it: its record holds the moment of "
                    "death)"
                )
            return line
        case events.Report():
            line = (
                f"  📝 report appended to {e.log}"
                if e.written
                else p("red", f"  ⚠ report not written ({e.error}): its record is on stderr")
            )
            return line + (f"\n  🔎 signature: {e.signature}" if e.signature else "")
        case events.Start():
            return p("yellow", f"▶ {e.service} is not running: starting it ({e.reason})")
        case events.Started():
            if e.recovered:
                return p("green", f"  ✅ started in {e.seconds:.1f}s")
            return p("red", f"  ❌ not started: {e.reason}")
        case events.RecoveryWait():
            return f"  ⏳ another loop recovers it: waiting for {e.by}"
        case events.RecoveryStep():
            if e.skipped:
                return p(
                    "dim", f"  ⏭ recovery attempt {e.attempt}: {e.step}: skipped ({e.skipped})"
                )
            return f"  🔁 recovery attempt {e.attempt}: {e.step}"
        case events.RecoveryFailed():
            then = "no attempt left" if e.retry_in is None else f"retrying in {e.retry_in:g} s"
            return p("yellow", f"  attempt {e.attempt} failed ({e.reason}): {then}")
        case events.Recovery():
            if not e.recovered:
                return p("red", f"  ❌ not recovered: {e.reason}")
            if e.by:
                return p("green", f"  ✅ up again in {e.seconds:.1f}s, brought back by {e.by}")
            return p("green", f"  ✅ recovered in {e.seconds:.1f}s ({e.attempts} attempt(s))")
        case events.Recorder():
            return p("dim", f"  recorder: {e.message}")
        case events.Receipt():
            return p(
                "dim",
                f"  🧾 {plural(e.requests, 'request')}: {e.prompt_tokens} prompt + "
                f"{e.generated_tokens} generated tokens",
            )
        case events.Output():
            return p("dim", "    │ ") + e.text
        case events.Warning():
            return p("yellow", f"  warning: {e.message}")
        case events.Done():
            return p("green", f"  done: {e.item}")
        case events.Retry():
            return p("yellow", "  service died during this attempt: retrying the item, no strike")
        case events.Strike():
            return p("yellow", f"  strike {e.strikes}/{e.of}: {e.reason}") + _tail(
                e.output_tail, p, STRIKE_TAIL_LINES, 2
            )
        case events.Skip():
            return p("red", f"  skipped after {e.strikes} failures: {e.item}")
        case events.AgentBroken():
            skipped = (
                "; skipped meanwhile: " + ", ".join(repr(i) for i in e.skipped)
                if e.skipped
                else "; nothing was skipped"
            )
            return (
                p(
                    "red",
                    f"✋ the agent is broken: it failed the same way on {e.previous_item!r} and "
                    f"{e.item!r} while the service was healthy: {e.reason}",
                )
                + _tail(e.output_tail, p, None)
                + "\n"
                + p("red", f"  stopped instead of skipping the rest (exit {e.exit_code}){skipped}")
            )
        case events.PauseRequested():
            by = f" by {e.by}" if e.by else ""
            when = ": stopping the step now" if e.now else ": after this iteration"
            return p("yellow", f"  pause asked for{by}{when}")
        case events.Paused():
            killed = f" ({e.killed} stopped, no strike: {e.item!r} comes again)" if e.killed else ""
            return p(
                "yellow", f"⏸ paused{killed} before the next iteration: `ralph-run resume` goes on"
            )
        case events.Resumed():
            return p("green", f"▶ resumed after {e.seconds:.0f} s paused")
        case events.PauseStep() | events.ResumeStep():
            which = "pause" if isinstance(e, events.PauseStep) else "resume"
            if e.skipped:
                return p("dim", f"  ⏭ {which} step: {e.step}: skipped ({e.skipped})")
            return f"  {'⏸' if which == 'pause' else '▶'} {which} step: {e.step}"
        case events.PauseSteps():
            if e.ok:
                return p("green", f"  pause steps done in {e.seconds:.1f}s")
            return p("red", f"  pause steps failed: {e.error}; still paused (no death, no strike)")
        case events.ResumeSteps():
            if e.ok:
                return p("green", f"  resume steps done in {e.seconds:.1f}s")
            return p(
                "yellow",
                f"  resume steps failed: {e.error}; going on: the service is checked now, "
                "and started if nothing listens",
            )
        case events.BlockStep():  # the runbook's setup: and teardown: (loop/lifecycle.py)
            if e.skipped:
                return p("dim", f"  ⏭ {e.block} step: {e.step}: skipped ({e.skipped})")
            return f"  {'🔑' if e.block == 'setup' else '🧹'} {e.block} step: {e.step}"
        case events.BlockSteps():
            if e.ok:
                return p("green", f"  {e.block} steps done in {e.seconds:.1f}s")
            then = "the run stops" if e.block == "setup" else "what setup holds may be held still"
            return p("red", f"  {e.block} steps failed: {e.error}; {then}")
        case events.Limited():
            reset = "  no reset time given" if e.guessed else f"  it resets at {e.reset}"
            then = (
                f": further than limits.max_wait, stopped (exit {e.exit_code}), no strike"
                if e.ends_run
                else f": waiting {span(e.seconds)}, then the item again (no strike)"
            )
            return (
                p("yellow", f"  ⏳ usage limit ({e.source}): {e.line}")
                + "\n"
                + p("red" if e.ends_run else "yellow", reset + then)
            )
        case events.LimitedWait():
            return p("dim", f"  ⏳ usage limit: {span(e.seconds)} left (until {e.until})")
        case events.Interrupted():
            return p("yellow", f"interrupted by {e.signal}: state saved (exit {e.exit_code})")
        case events.WorkerStarted():
            strikable = "" if e.strikable else " (earlier items unsettled: no strike if it fails)"
            return p("bold", f"worker {e.worker}: iteration {e.iteration}: {e.item}") + p(
                "dim", f"  on {e.branch}{strikable}"
            )
        case events.WorkerLanded():
            return p("green", f"  worker {e.worker} landed {e.item!r}") + p(
                "dim", f"  ({plural(e.commits, 'commit')}, head {e.head[:10]})"
            )
        case events.WorkerConflict():
            return p(
                "yellow",
                f"  worker {e.worker}: {e.item!r} conflicts with what landed "
                f"({e.conflicts}/{e.of}): retried on the new head, no strike",
            )
        case events.WorkerRetry():
            then = "once the earlier items settle" if e.waits else "now"
            line = f"  worker {e.worker}: {e.item!r} again {then}, no strike ({e.reason})"
            return p("yellow", line)
        case events.Governed():
            more = "admitted" if e.workers > e.was else "shed"
            line = f"  governor: {e.was} -> {e.workers} of {e.of} workers ({more}: {e.reason})"
            return p("cyan", line)
        case events.Summary():
            how = "stopped at max_iterations: " if e.stopped_at_max else "checklist finished: "
            return p(
                "bold",
                f"{how}{e.iterations} iterations, {e.done} done, {e.todo} todo, "
                f"{e.skipped} skipped, {e.deaths} deaths, {e.seconds:.1f}s",
            ) + "".join(
                p("dim", f"\n  {count} x {signature}") for signature, count in e.signatures.items()
            )
        case events.Fleet():
            return p("bold", f"{len(e.hosts)} hosts, {e.forks} at a time: {', '.join(e.hosts)}")
        case events.HostDone():
            colour = "green" if e.exit_code == 0 else "yellow"
            return p(colour, f"loop ended: exit {e.exit_code}")
        case events.HostSays():
            return e.text
        case events.FleetSummary():
            return _fleet_table(e, p)
    return None


def _step_status(e: events.StepDone) -> str:
    """How a failed step ended: the loop's words (loop/failures.status_text), else the same
    words from the event's fields; never "exit None"."""
    return e.status or step_ended(e.exit_code, e.timed_out, e.killed) or "failed"


def _tail(tail: str | None, p: Painter, lines: int | None, least: int = 1) -> str:
    """An output tail as indented lines under its event (the last `lines`, None: all), if it
    has at least `least` lines (a strike's reason holds the last line already)."""
    shown = [line for line in (tail or "").split("\n") if line.strip()]
    if len(shown) < least:
        return ""
    if lines is not None:
        shown = shown[-lines:]
    return "".join("\n" + p("dim", "    │ ") + line for line in shown)


def _fleet_table(e: events.FleetSummary, p: Painter) -> str:
    """The fleet's end: one row per host."""
    header = ("host", "done", "todo", "skipped", "deaths", "exit")
    rows = [
        [str(v if v is not None else "-") for v in (r["host"], r["done"], r["todo"], r["skipped"],
                                                     r["deaths"], r["exit_code"])]
        for r in e.hosts
    ]  # fmt: skip
    lines = columns([header, *rows])
    return "\n".join([p("bold", lines[0]), *lines[1:], p("bold", f"fleet exit code {e.exit_code}")])


# -- text for people, in one style: every table, count and cut-off line ralph-run prints ----------


def columns(rows: Sequence[Sequence[str]], align: str = "", indent: str = "") -> list[str]:
    """`rows` (a header first, if any) as lines of columns two spaces apart, each as wide as
    its widest cell; `align` holds "<" or ">" per column (left where it says nothing). No line
    ends in spaces, so the last column is never padded."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        (
            indent
            + "  ".join(
                cell.rjust(width) if align[i : i + 1] == ">" else cell.ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        ).rstrip()
        for row in rows
    ]


def step_ended(
    exit_code: int | None, timed_out: bool, killed: bool, stalled: str | None = None
) -> str | None:
    """How a step ended, in words: "killed (service died)", "timed out", "stalled (why)",
    "exit 137 (SIGKILL)"; None when it has no exit code (the caller says why)."""
    if killed:
        return "killed (service died)"
    if timed_out:
        return "timed out"
    if stalled:
        return f"stalled ({stalled})"
    if exit_code is None:
        return None
    if 128 < exit_code <= 128 + 64:
        try:
            return f"exit {exit_code} ({signal.Signals(exit_code - 128).name})"
        except ValueError:
            pass
    return f"exit {exit_code}"


IRREGULAR = {"recovery": "recoveries", "process": "processes"}


def plural(count: object, noun: str) -> str:
    """A count with its noun: "1 death", "3 deaths", "2 recoveries", "? attempts"."""
    return f"{count} {noun if count == 1 else IRREGULAR.get(noun, noun + 's')}"


# C0 controls but tab and newline, DEL and C1: what can move a terminal's cursor or start an
# escape sequence, shown as \xNN instead (an item, a status line, a loop's output in `top`)
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)}


def printable(text: str) -> str:
    """`text` safe for a terminal: its control characters (ESC, CR, BEL...; not tab or newline)
    written as `\\x1b`, so text from a checklist or a file never drives the terminal."""
    return text.translate(_CONTROLS)


def shorten(text: str, width: int) -> str:
    """`text` cut to at most `width` characters, a cut marked with "…"."""
    return text if len(text) <= width else text[: width - 1] + "…"


def span(seconds: float) -> str:
    """A wait in words: "3 h 12 min", "45 s"."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    if minutes:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    return f"{secs} s"
