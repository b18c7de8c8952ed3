"""What `ralph-run top` reads of one loop, and how it draws it (top.py runs the screen).

One read is one look at the loop's `.ralph/`: status.json (the row), state.json (the exact
time of the last death, and the last failed attempt's masked output), the end of
iterations.jsonl (the last iterations, their receipts, the items per hour) and, for the selected
loop only, the end of the flight recorder's ring (its /metrics samples and the server's log
lines, masked as the recorder wrote them). Files are read directly here; a remote loop's are read
by one shell command over its connection, one round trip, `tail` for the files that grow.

No file holds the agent's output as it runs (the loop only prints it), so the details show the
last failed attempt's output tail (state.json, masked) or else the server's last log lines from
the ring.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from ralph_runner.commands import status as status_command
from ralph_runner.deaths.recorder import DIRECTORY, SEGMENT_GLOB
from ralph_runner.loop import pause as pause_control
from ralph_runner.process import connection
from ralph_runner.workspace.state_files import HISTORY_FILE, STATE_DIR

HISTORY_TAIL = 30  # iterations read of each loop: the last ones shown, the items per hour
HISTORY_SHOWN = 5  # ... of which the details show at most this many
TAIL_BYTES = 64 * 1024  # what is read of a local iterations.jsonl: its end only
RING_BYTES = 128 * 1024  # of each of the ring's two newest segments (the selected loop only)
LOG_LINES = 6  # the most output lines the details show
RATE_WINDOW = 3600.0  # items per hour: the done iterations that started in the last hour ...
RATE_FLOOR = 60.0  # ... over at least a minute (one quick item is not 1,000 an hour)
SEP = "--ralph-top--"
BARS = "▁▂▃▄▅▆▇█"
GENERATED = "vllm:generation_tokens_total"
KV_CACHE = "vllm:kv_cache_usage_perc"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
# One round trip: the pid's liveness and status.json, state.json, the history's end, the ring's.
REMOTE = """d={dir}
if [ -r "$d/status.json" ]; then
  pid=$(sed -n 's/.*"pid": *\\([0-9][0-9]*\\).*/\\1/p' "$d/status.json" | head -n 1)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then s=alive; else s=gone; fi
  if [ -e "$d/{pause}" ]; then echo "$s {pause}"; else echo "$s"; fi
  cat -- "$d/status.json"
else echo missing; fi
echo; echo {sep}; cat -- "$d/state.json" 2>/dev/null
echo; echo {sep}; tail -n {lines} -- "$d/{history}" 2>/dev/null
echo; echo {sep}
{ring}exit 0
"""
REMOTE_RING = (  # the end of the two newest segments together: what crosses the network
    'ls -1 "$d"/{directory}/{glob} 2>/dev/null | tail -n 2 |'
    ' while read -r f; do tail -c {bytes} -- "$f"; echo; done | tail -c {bytes}\n'
)
REMOTE_RING_BYTES = 64 * 1024
REMOTE_OUTPUT = 1024 * 1024  # bytes of its output kept (execute keeps the end)


@dataclass
class Snapshot:
    """One read of one loop: its status (or why there is none) and what the details show."""

    row: dict[str, Any]  # status.json, "running" checked; or {"error", "reachable"}
    history: list[dict[str, Any]] = field(default_factory=list)
    death_time: float | None = None  # state.json's last death, to the millisecond
    failure: dict[str, Any] | None = None  # state.json's last failed attempt
    samples: list[dict[str, Any]] | None = None  # the ring's; None: not read (not selected)
    log: list[str] = field(default_factory=list)  # the ring's last server log lines
    wall: float = field(default_factory=time.time)  # when it was read

    @property
    def answered(self) -> bool:
        """The loop's place answered (a missing status is an answer; no connection is not)."""
        return bool(self.row.get("reachable", True))


# -- reading --------------------------------------------------------------------------
def read_local(workdir: str, detailed: bool) -> Snapshot:
    """A workdir on this machine, read directly (no process started)."""
    base = Path(workdir) / STATE_DIR
    try:
        text = (base / "status.json").read_text("utf-8")
    except FileNotFoundError:
        return Snapshot({"error": "no status (never run here?)", "reachable": True})
    except (OSError, UnicodeDecodeError) as exc:
        return Snapshot({"error": f"status.json: {exc}", "reachable": True})
    row = _object(text)
    if row is None:
        return Snapshot({"error": "unreadable status.json", "reachable": True})
    row["running"] = bool(row.get("running")) and status_command.pid_alive(row.get("pid"))
    row["pause_left"] = not row["running"] and (base / pause_control.CONTROL).exists()
    state = _object(_read(base / "state.json")) or {}
    history = _read(base / HISTORY_FILE, TAIL_BYTES)
    ring = ""
    if detailed:
        segments = sorted((base / DIRECTORY).glob(SEGMENT_GLOB))[-2:]
        ring = "\n".join(_read(path, RING_BYTES) for path in segments)
    return _snapshot(row, state, history, ring if detailed else None)


def read_remote(
    conn: connection.Connection, workdir: str, detailed: bool, timeout: float
) -> Snapshot:
    """A loop on another host: one shell command over its connection, within `timeout`."""
    where = f"{workdir.rstrip('/')}/{STATE_DIR}"
    ring = REMOTE_RING.format(directory=DIRECTORY, glob=SEGMENT_GLOB, bytes=REMOTE_RING_BYTES)
    command = REMOTE.format(
        dir=remote_path(where),
        sep=SEP,
        lines=HISTORY_TAIL,
        history=HISTORY_FILE,
        ring=ring if detailed else "",
        pause=pause_control.CONTROL,
    )
    result = conn.shell(command, timeout=timeout, max_output=REMOTE_OUTPUT)
    if result.timed_out:
        return Snapshot({"error": f"no answer within {timeout:g} s", "reachable": False})
    if result.exit_code == connection.SSH_UNREACHABLE and isinstance(conn, connection.Ssh):
        lines = result.output.strip().splitlines()
        return Snapshot({"error": lines[-1] if lines else "ssh failed", "reachable": False})
    parts: list[list[str]] = [[], [], [], []]
    index = 0
    for line in result.output.split("\n"):
        if line == SEP and index < 3:
            index += 1
        else:
            parts[index].append(line)
    first, *status_lines = parts[0] or ["missing"]
    alive, *flags = first.split() or ["missing"]
    if result.exit_code != 0 or alive == "missing":
        return Snapshot({"error": f"no status at {where}/status.json", "reachable": True})
    row = _object("\n".join(status_lines))
    if row is None:
        return Snapshot({"error": f"unreadable status at {where}/status.json", "reachable": True})
    row["running"] = bool(row.get("running")) and alive == "alive"
    row["pause_left"] = not row["running"] and pause_control.CONTROL in flags
    state = _object("\n".join(parts[1])) or {}
    return _snapshot(row, state, "\n".join(parts[2]), "\n".join(parts[3]) if detailed else None)


def remote_path(path: str) -> str:
    """A path as one word of a remote shell command; `~/...` stays under the remote home."""
    return f'"$HOME"/{shlex.quote(path[2:])}' if path.startswith("~/") else shlex.quote(path)


def _snapshot(
    row: dict[str, Any], state: dict[str, Any], history: str, ring: str | None
) -> Snapshot:
    times = state.get("death_times")
    death_time = times[-1] if isinstance(times, list) and times else None
    failure = state.get("last_failure")
    snapshot = Snapshot(
        row,
        history=_lines(history)[-HISTORY_TAIL:],
        death_time=death_time if isinstance(death_time, int | float) else None,
        failure=failure if isinstance(failure, dict) else None,
    )
    if ring is not None:
        entries = _lines(ring, keep=('"sample"', '"log"'))
        snapshot.samples = [e for e in entries if isinstance(e.get("sample"), dict)]
        snapshot.log = [e["log"] for e in entries if isinstance(e.get("log"), str)][-LOG_LINES:]
    return snapshot


def _read(path: Path, tail: int | None = None) -> str:
    try:
        with open(path, "rb") as file:
            if tail is not None:
                file.seek(max(0, os.fstat(file.fileno()).st_size - tail))
            return file.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _object(text: str) -> dict[str, Any] | None:
    try:
        found = orjson.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _lines(text: str, keep: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL text's lines (a torn first or last line is skipped); with
    `keep`, only the lines that hold one of those strings are parsed."""
    found = []
    for line in text.split("\n"):
        if not line or (keep and not any(k in line for k in keep)):
            continue
        entry = _object(line)
        if entry is not None:
            found.append(entry)
    return found


# -- the table's cells ----------------------------------------------------------------
def state_text(row: dict[str, Any], death_time: float | None, now: float) -> str:
    """What the loop does: paused, recovering (a death recorded, the status not rewritten by a
    step since), waiting for a usage limit's reset, running, pausing, dead, or how it ended."""
    pause = row.get("pause") or {}
    if not row.get("running"):
        ended = "dead" if row.get("status") == "running" else str(row.get("status", "?"))
        # a pause left behind holds the next run before its first iteration: r clears it
        return f"{ended}, paused" if row.get("pause_left") else ended
    if row.get("paused"):
        return "paused"
    if recovering(row, death_time):
        return f"recovering {duration(now - death_time)}" if death_time else "recovering"
    limited = row.get("limited") or {}
    until = limited.get("until") if isinstance(limited, dict) else None
    if isinstance(until, int | float):
        return f"limited {duration(until - now)}"
    return str(pause.get("state") or "running")


def recovering(row: dict[str, Any], death_time: float | None) -> bool:
    """The last status write was the death's: the step it shows began before the death (every
    step after the recovery writes a later `step_started`, a new iteration none)."""
    last = row.get("last_death")
    started, updated = row.get("step_started"), row.get("updated")
    if not isinstance(last, dict) or last.get("death") != row.get("deaths") or not death_time:
        return False
    if not isinstance(started, int | float) or not isinstance(updated, int | float):
        return False
    return started < death_time <= updated


def cells(snapshot: Snapshot, now: float, stale: str | None = None) -> list[str]:
    """The row's cells after the loop's name: state, it, item, step, /h, deaths, d/t/s."""
    row = snapshot.row
    if "error" in row:
        what = stale or ("unreachable" if not row.get("reachable") else "no status")
        return [what, "", row["error"], "", "", "", ""]
    if stale:
        now = snapshot.wall  # the last known row, frozen as it was read
    item = row.get("item") or ""
    if item:
        item += f" ({row.get('attempts', 0) + 1})"
    pause = row.get("pause") or {}
    since = pause.get("since") if row.get("paused") else row.get("step_started")
    step = duration(now - since) if row.get("running") and isinstance(since, int | float) else ""
    deaths = str(row.get("deaths", 0))  # the last one's fault: in the details' title
    counts = f"{row.get('done', 0)}/{row.get('todo', 0)}/{row.get('skipped', 0)}"
    return [
        stale or state_text(row, snapshot.death_time, now),
        str(row.get("iteration", 0)),
        item,
        step,
        per_hour(snapshot.history, now if row.get("running") else None),
        deaths,
        counts,
    ]


def per_hour(history: list[dict[str, Any]], now: float | None) -> str:
    """Items done per hour: the done iterations that started in the hour before `now` (None: a
    loop that ended, up to its last iteration's end), over the time since the first of the
    iterations read in that hour (at least a minute)."""
    if now is None:
        ends = [
            line["started"] + (line.get("seconds") or 0)
            for line in history
            if isinstance(line.get("started"), int | float)
            and isinstance(line.get("seconds") or 0, int | float)
        ]
        if not ends:
            return ""
        now = max(ends)
    starts = [
        (line["started"], line.get("outcome") == "done")
        for line in history
        if isinstance(line.get("started"), int | float) and line["started"] >= now - RATE_WINDOW
    ]
    if not starts:
        return ""
    done = sum(1 for _, was_done in starts if was_done)
    span = max(RATE_FLOOR, now - min(start for start, _ in starts))
    rate = done * 3600.0 / span
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.1f}"


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# -- the selected loop's details --------------------------------------------------------
def sparkline(values: list[float | None], width: int, top: float | None = None) -> str:
    """The last `width` values as bars from 0 to `top` (default: their largest); a gap (no
    sample: the server was down) is a space."""
    shown = values[-width:]
    high = top if top is not None else max((v for v in shown if v is not None), default=0.0)
    bars = []
    for value in shown:
        if value is None:
            bars.append(" ")
        else:
            level = int(value / high * len(BARS)) if high > 0 else 0
            bars.append(BARS[max(0, min(len(BARS) - 1, level))])
    return "".join(bars).rjust(width)


def series(samples: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """The engine's tokens/s (the generation counter's rate between samples), KV-cache use (%)
    and running / waiting requests, one value per sample, None where it had none."""
    found: dict[str, list[float | None]] = {"tok/s": [], "kv %": [], "run": [], "wait": []}
    previous: tuple[float, float] | None = None
    for entry in samples:
        metrics = entry["sample"].get("metrics") or {}
        t, generated = entry.get("t"), metrics.get(GENERATED)
        rate = None
        if isinstance(t, int | float) and isinstance(generated, int | float):
            if previous and t > previous[0] and generated >= previous[1]:
                rate = (generated - previous[1]) / (t - previous[0])
            previous = (t, generated)
        else:
            previous = None
        kv = metrics.get(KV_CACHE)
        found["tok/s"].append(rate)
        found["kv %"].append(kv * 100.0 if isinstance(kv, int | float) else None)
        found["run"].append(_number(metrics.get(RUNNING)))
        found["wait"].append(_number(metrics.get(WAITING)))
    return found


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def engine_lines(samples: list[dict[str, Any]] | None, width: int) -> list[Text]:
    """Two lines of sparklines from the recorder's ring: tokens/s and KV cache, then running
    and waiting requests, each with its last value."""
    if samples is None:
        return [Text("  engine: reading...")]
    if not samples:
        return [Text("  engine: no recorder samples (the runbook has no recorder: url)")]
    found = series(samples)
    spark = max(4, (width - 2 * 18) // 2)
    lines = []
    for left, right, top in (("tok/s", "kv %", 100.0), ("run", "wait", None)):
        parts = []
        for name, limit in ((left, None), (right, top)):
            values = found[name]
            last = values[-1] if values else None  # none: the server is down now
            shown = "-" if last is None else f"{last:.0f}"
            parts.append(f"{name:>5} {sparkline(values, spark, limit)} {shown:>6}")
        lines.append(Text("  " + "    ".join(parts), no_wrap=True, overflow="ellipsis"))
    return lines


def iterations(lines: list[dict[str, Any]], rows: int) -> RenderableType:
    """The last iterations with their receipts: tokens (prompt/generated, this loop's own
    through the proxy, else the server's prompt counter), the commit, the lines changed."""
    if not lines or rows <= 0:
        return Text("  no iteration finished yet")
    table = Table(box=None, pad_edge=False, show_header=True, expand=True)
    for name, justify in (("it", "right"), ("outcome", "left"), ("time", "right")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    table.add_column("tokens p/g", justify="right", no_wrap=True)
    table.add_column("commit", no_wrap=True)
    table.add_column("+/-", justify="right", no_wrap=True)
    table.add_column("item", no_wrap=True, overflow="ellipsis", ratio=1)
    for line in lines[-rows:]:
        seconds = line.get("seconds")
        commit = line.get("commit")
        changed = ""
        if commit and isinstance(line.get("insertions"), int):
            changed = f"+{line['insertions']} -{line.get('deletions') or 0}"
        table.add_row(
            str(line.get("iteration", "")),
            str(line.get("outcome", "")),
            duration(seconds) if isinstance(seconds, int | float) else "",
            _tokens(line),
            str(commit)[:7] if commit else "-",
            changed,
            str(line.get("item", "")),
        )
    return table


def _tokens(line: dict[str, Any]) -> str:
    receipt = line.get("receipt")
    if isinstance(receipt, dict):
        return f"{_count(receipt.get('prompt_tokens'))}/{_count(receipt.get('generated_tokens'))}"
    prompt = line.get("prompt_tokens")
    return f"{_count(prompt)}/?" if isinstance(prompt, int) else ""


def _count(value: Any) -> str:
    if not isinstance(value, int | float):
        return "?"
    return f"{value / 1000:.1f}k" if value >= 10_000 else str(int(value))


def output_lines(snapshot: Snapshot | None, rows: int) -> list[Text]:
    """The last output there is: the last failed attempt's (masked by the loop), else the
    server's log lines from the recorder's ring (masked by the recorder)."""
    if rows <= 0:
        return []
    if snapshot is None:
        return [Text("  output: reading...")]
    failure = snapshot.failure
    if failure and str(failure.get("output_tail") or "").strip():
        title = f"  last failed attempt's output ({failure.get('item')}):"
        text = str(failure["output_tail"]).splitlines()
    elif snapshot.log:
        title, text = "  server log (recorder):", snapshot.log
    else:
        return [Text("  output: none recorded (no failed attempt, no recorder log)")]
    shown = [Text(title, no_wrap=True, overflow="ellipsis")]
    for line in text[-(rows - 1) :] if rows > 1 else []:
        shown.append(Text("    " + line.expandtabs(4), no_wrap=True, overflow="ellipsis"))
    return shown


def last_death_text(row: dict[str, Any]) -> str:
    last = row.get("last_death")
    if not isinstance(last, dict):
        return ""
    when = str(last.get("time") or "")
    with contextlib.suppress(ValueError):
        when = datetime.fromisoformat(when).strftime("%H:%M:%S")
    return f"death {last.get('death')} at {when} in {last.get('phase')}: {last.get('fault')}"


def table(rows: list[tuple[str, list[str], str | None]]) -> Table:
    """The loops' table; each row is (name, cells, style)."""
    grid = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False)
    grid.add_column("loop", no_wrap=True, max_width=12, overflow="ellipsis")
    grid.add_column("state", no_wrap=True, max_width=16, overflow="ellipsis")
    grid.add_column("it", justify="right", no_wrap=True)
    grid.add_column("item (attempt)", no_wrap=True, overflow="ellipsis", ratio=1, min_width=10)
    grid.add_column("step", justify="right", no_wrap=True)
    grid.add_column("/h", justify="right", no_wrap=True)
    grid.add_column("deaths", justify="right", no_wrap=True)
    grid.add_column("d/t/s", no_wrap=True)
    for name, row_cells, style in rows:
        grid.add_row(name, *row_cells, style=style)
    return grid


def details(
    title: str,
    snapshot: Snapshot | None,
    detailed: Snapshot | None,
    width: int,
    budget: int | None,
) -> list[RenderableType]:
    """Under the table, in `budget` lines (None: no limit): the selected loop's engine
    sparklines, its last iterations and its last output."""
    parts: list[RenderableType] = [Text(title, no_wrap=True, overflow="ellipsis")]
    if snapshot is None or "error" in snapshot.row:
        return [*parts, Text(f"  {snapshot.row['error'] if snapshot else 'reading...'}")]
    engine = engine_lines(detailed.samples if detailed else None, width)
    history = snapshot.history if snapshot else []
    if budget is None:
        shown, out = HISTORY_SHOWN, LOG_LINES + 1
    else:
        left = budget - 1 - len(engine)
        shown = max(0, min(HISTORY_SHOWN, len(history) or 1, (left - 2) // 2))
        out = left - (1 + shown)
        if left < 2:
            engine, shown, out = [], 0, max(0, budget - 1)
    parts += engine
    if shown or budget is None:
        parts.append(iterations(history, shown))
    parts += output_lines(detailed, out)
    return parts
