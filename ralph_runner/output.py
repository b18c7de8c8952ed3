"""The run's event bus, and what the operator sees of it: readable lines (coloured on a
terminal) or one JSON event per line; the one style of text for people."""

from __future__ import annotations

import json
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
                render = HUMAN.get(kind)
                if render is None or (kind in VERBOSE_ONLY and not self.verbose):
                    return
                line = render(fields, self._paint)
                if event.host is not None:  # a fleet run: every line says whose it is
                    line = self._paint("cyan", f"[{event.host}]") + " " + line
                elapsed = time.monotonic() - self._started
                line = self._paint("dim", f"[{_clock(elapsed)}]") + " " + line
                if self.colour:
                    line = "\r\033[K" + line  # over the ticker's line, if one is drawn
            print(line, file=self.stream, flush=True)

    def _tick(self, step: str | None) -> None:
        """On a terminal, a live line under the log: the running step and its elapsed time."""
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        if step is not None:
            self._ticker = _Ticker(self.stream, self._lock, self._paint("cyan", f"  … {step}"))

    def _paint(self, colour: str, text: str) -> str:
        return f"\033[{COLOURS[colour]}m{text}\033[0m" if self.colour else text


class EventBus:
    """`emit(event)` is the one way the run reports; thread-safe. Every follower, the console
    last, sees the event with its secrets masked."""

    def __init__(self, console: Console, redactor: Redactor | None = None) -> None:
        self.console = console
        self.redactor = redactor or Redactor([])
        self._followers: list[Follower] = []

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

    def __init__(self, stream: IO[str], lock: threading.Lock, label: str) -> None:
        self.stream, self.lock, self.label = stream, lock, label
        self.started = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ticker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(1.0):
            with self.lock:
                seconds = time.monotonic() - self.started
                self.stream.write(f"\r\033[K{self.label} {_clock(seconds)}")
                self.stream.flush()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        with self.lock:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}"


Painter = Callable[[str, str], str]

HUMAN: dict[str, Callable[[dict, Painter], str]] = {
    "resume": lambda f, p: p(
        "yellow", f"resuming at iteration {f['iteration']} ({f['deaths']} deaths so far)"
    ),
    "iteration": lambda f, p: (
        p("bold", f"iteration {f['iteration']}: {f['item']}")
        + p(
            "dim",
            f"  (strikes {f['attempts']}, prompt {f['prompt_size']} chars; "
            f"{f['done']} done, {f['todo']} todo, {f['skipped']} skipped, "
            f"{f['deaths']} deaths)",
        )
    ),
    "step": lambda f, p: f"  → {f['step']}",
    "step-done": lambda f, p: (
        "  "
        + (p("green", "✓") if f["ok"] else p("red", "✗"))
        + f" {f['step']} "
        + p("dim", f"{f['seconds']:.1f}s")
        + ("" if f["ok"] else " " + p("red", _step_status(f)))
    ),
    "watch": lambda f, p: p("red", f"  ! service died during {f['step']}: step killed"),
    "death": lambda f, p: p(
        "red",
        f"💀 death #{f['death']} at {f['phase']}: "
        + (f"{f['fault']} ({f['reason']})" if f.get("fault") else f"{f['reason']}"),
    ),
    "capture": lambda f, p: (
        f"  capturing {f['collectors']} diagnostics"
        + (
            f" (while {f['during_recovery']} recovers it: its record holds the moment of death)"
            if f.get("during_recovery")
            else ""
        )
    ),
    "report": lambda f, p: (
        (
            f"  📝 report appended to {f['log']}"
            if f.get("written", True)
            else p("red", f"  ⚠ report not written ({f['error']}): its record is on stderr")
        )
        + (f"\n  🔎 signature: {f['signature']}" if f.get("signature") else "")
    ),
    "start": lambda f, p: p(
        "yellow", f"▶ {f['service']} is not running: starting it ({f['reason']})"
    ),
    "started": lambda f, p: (
        p("green", f"  ✅ started in {f['seconds']:.1f}s")
        if f["recovered"]
        else p("red", f"  ❌ not started: {f['reason']}")
    ),
    "recovery-wait": lambda f, p: f"  ⏳ another loop recovers it: waiting for {f['by']}",
    "recovery-step": lambda f, p: (
        p("dim", f"  ⏭ recovery attempt {f['attempt']}: {f['step']}: skipped ({f['skipped']})")
        if f.get("skipped")
        else f"  🔁 recovery attempt {f['attempt']}: {f['step']}"
    ),
    "recovery-failed": lambda f, p: p(
        "yellow",
        f"  attempt {f['attempt']} failed ({f['reason']}): "
        + (
            "no attempt left"
            if f.get("retry_in") is None
            else f"retrying in {_seconds(f['retry_in'])}"
        ),
    ),
    "recovery": lambda f, p: (
        p("red", f"  ❌ not recovered: {f['reason']}")
        if not f["recovered"]
        else p("green", f"  ✅ up again in {f['seconds']:.1f}s, brought back by {f['by']}")
        if f.get("by")
        else p("green", f"  ✅ recovered in {f['seconds']:.1f}s ({f['attempts']} attempt(s))")
    ),
    "recorder": lambda f, p: p("dim", f"  recorder: {f['message']}"),
    "receipt": lambda f, p: p(
        "dim",
        f"  🧾 {plural(f.get('requests', 0), 'request')}: {f.get('prompt_tokens', 0)} prompt + "
        f"{f.get('generated_tokens', 0)} generated tokens",
    ),
    "output": lambda f, p: p("dim", "    │ ") + f["text"],
    "warning": lambda f, p: p("yellow", f"  warning: {f['message']}"),
    "done": lambda f, p: p("green", f"  done: {f['item']}"),
    "retry": lambda f, p: p(
        "yellow", "  service died during this attempt: retrying the item, no strike"
    ),
    "strike": lambda f, p: (
        p("yellow", f"  strike {f['strikes']}/{f['of']}: {f['reason']}")
        + _tail(f.get("output_tail"), p, STRIKE_TAIL_LINES, 2)
    ),
    "skip": lambda f, p: p("red", f"  skipped after {f['strikes']} failures: {f['item']}"),
    "agent-broken": lambda f, p: (
        p(
            "red",
            f"✋ the agent is broken: it failed the same way on {f['previous_item']!r} and "
            f"{f['item']!r} while the service was healthy: {f['reason']}",
        )
        + _tail(f.get("output_tail"), p, None)
        + "\n"
        + p(
            "red",
            f"  stopped instead of skipping the rest (exit {f['exit_code']})"
            + (
                "; skipped meanwhile: " + ", ".join(repr(i) for i in f["skipped"])
                if f.get("skipped")
                else "; nothing was skipped"
            ),
        )
    ),
    "pause-requested": lambda f, p: p(
        "yellow",
        "  pause asked for"
        + (f" by {f['by']}" if f.get("by") else "")
        + (": stopping the step now" if f.get("now") else ": after this iteration"),
    ),
    "paused": lambda f, p: p(
        "yellow",
        "⏸ paused"
        + (
            f" ({f['killed']} stopped, no strike: {f['item']!r} comes again)"
            if f.get("killed")
            else ""
        )
        + " before the next iteration: `ralph-run resume` goes on",
    ),
    "resumed": lambda f, p: p("green", f"▶ resumed after {f['seconds']:.0f} s paused"),
    "pause-step": lambda f, p: _block_step("pause", f, p),
    "resume-step": lambda f, p: _block_step("resume", f, p),
    "pause-steps": lambda f, p: (
        p("green", f"  pause steps done in {f['seconds']:.1f}s")
        if f["ok"]
        else p("red", f"  pause steps failed: {f['error']}; still paused (no death, no strike)")
    ),
    "resume-steps": lambda f, p: (
        p("green", f"  resume steps done in {f['seconds']:.1f}s")
        if f["ok"]
        else p(
            "yellow",
            f"  resume steps failed: {f['error']}; going on: the service is checked now, "
            "and started if nothing listens",
        )
    ),
    "limited": lambda f, p: (
        p("yellow", f"  ⏳ usage limit ({f['source']}): {f['line']}")
        + "\n"
        + p(
            "red" if f.get("ends_run") else "yellow",
            ("  no reset time given" if f.get("guessed") else f"  it resets at {f['reset']}")
            + (
                f": further than limits.max_wait, stopped (exit {f['exit_code']}), no strike"
                if f.get("ends_run")
                else f": waiting {span(f['seconds'])}, then the item again (no strike)"
            ),
        )
    ),
    "limited-wait": lambda f, p: p(
        "dim", f"  ⏳ usage limit: {span(f['seconds'])} left (until {f['until']})"
    ),
    "interrupted": lambda f, p: p(
        "yellow", f"interrupted by {f['signal']}: state saved (exit {f['exit_code']})"
    ),
    "summary": lambda f, p: (
        p(
            "bold",
            ("stopped at max_iterations: " if f["stopped_at_max"] else "checklist finished: ")
            + f"{f['iterations']} iterations, {f['done']} done, "
            f"{f['todo']} todo, {f['skipped']} skipped, "
            f"{f['deaths']} deaths, {f['seconds']:.1f}s",
        )
        + "".join(
            p("dim", f"\n  {count} x {signature}")
            for signature, count in f.get("signatures", {}).items()
        )
    ),
}
VERBOSE_ONLY = {"step"}
STRIKE_TAIL_LINES = 5  # the agent's last words under a strike; the whole tail is in --json


def _step_status(f: dict) -> str:
    """How a failed step ended: the loop's words (loop/failures.status_text), else the same
    words from the event's fields; never "exit None"."""
    ended = step_ended(f.get("exit_code"), bool(f.get("timed_out")), bool(f.get("killed")))
    return f.get("status") or ended or "failed"


def _block_step(which: str, f: dict, p: Painter) -> str:
    """A step of the runbook's `pause:` or `resume:` block, as recovery steps are shown."""
    if f.get("skipped"):
        return p("dim", f"  ⏭ {which} step: {f['step']}: skipped ({f['skipped']})")
    return f"  {'⏸' if which == 'pause' else '▶'} {which} step: {f['step']}"


def _tail(tail: str | None, p: Painter, lines: int | None, least: int = 1) -> str:
    """An output tail as indented lines under its event (the last `lines`, None: all), if it
    has at least `least` lines (a strike's reason holds the last line already)."""
    shown = [line for line in (tail or "").split("\n") if line.strip()]
    if len(shown) < least:
        return ""
    if lines is not None:
        shown = shown[-lines:]
    return "".join("\n" + p("dim", "    │ ") + line for line in shown)


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _fleet_table(f: dict, p: Painter) -> str:
    """The fleet's end: one row per host."""
    header = ("host", "done", "todo", "skipped", "deaths", "exit")
    rows = [[str(v if v is not None else "-") for v in row.values()] for row in f["hosts"]]
    lines = columns([header, *rows])
    return "\n".join(
        [p("bold", lines[0]), *lines[1:], p("bold", f"fleet exit code {f['exit_code']}")]
    )


HUMAN.update(
    {
        "fleet": lambda f, p: p(
            "bold", f"{len(f['hosts'])} hosts, {f['forks']} at a time: {', '.join(f['hosts'])}"
        ),
        "host-done": lambda f, p: p(
            "green" if f["exit_code"] == 0 else "yellow", f"loop ended: exit {f['exit_code']}"
        ),
        "host-says": lambda f, p: f["text"],
        "fleet-summary": _fleet_table,
    }
)


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


IRREGULAR = {"recovery": "recoveries"}


def plural(count: object, noun: str) -> str:
    """A count with its noun: "1 death", "3 deaths", "2 recoveries", "? attempts"."""
    return f"{count} {noun if count == 1 else IRREGULAR.get(noun, noun + 's')}"


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
