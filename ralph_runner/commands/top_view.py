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
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import orjson
from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from ralph_runner.commands import status as status_command
from ralph_runner.deaths.recorder import DIRECTORY, SEGMENT_GLOB
from ralph_runner.durable.json_value import JSON, JSONObject
from ralph_runner.loop import pause as pause_control
from ralph_runner.loop.state import LastFailure, State
from ralph_runner.output import durations
from ralph_runner.output.text import printable
from ralph_runner.process import connection
from ralph_runner.workspace import status_file
from ralph_runner.workspace.state_files import HISTORY_FILE, STATE_DIR, STATE_FILE
from ralph_runner.workspace.status_file import STATUS_FILE, CheckedStatus

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
if [ -r "$d/{status}" ]; then
  pid=$(sed -n 's/.*"pid": *\\([0-9][0-9]*\\).*/\\1/p' "$d/{status}" | head -n 1)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then s=alive; else s=gone; fi
  if [ -e "$d/{pause}" ]; then echo "$s {pause}"; else echo "$s"; fi
  cat -- "$d/{status}"
else echo missing; fi
echo; echo {sep}; cat -- "$d/{state}" 2>/dev/null
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
class LoopReading:
    """One read of one loop: its status (or why there is none) and what the details show."""

    status: CheckedStatus | None  # None: not read, `error` says why
    error: str = ""
    reachable: bool = True  # the loop's place answered (a missing status is an answer)
    history: list[JSONObject] = field(default_factory=list)
    death_time: float | None = None  # state.json's last death, to the millisecond
    failure: LastFailure | None = None  # state.json's last failed attempt
    samples: list[JSONObject] | None = None  # the ring's; None: not read (not selected)
    log: list[str] = field(default_factory=list)  # the ring's last server log lines
    wall: float = field(default_factory=time.time)  # when it was read

    @classmethod
    def unread(cls, error: str, reachable: bool = True) -> LoopReading:
        """No status: why (`reachable`: the place answered, as a missing file does)."""
        return cls(None, error, reachable)


# -- reading --------------------------------------------------------------------------
def read_local(workdir: str, detailed: bool) -> LoopReading:
    """A workdir on this machine, read directly (no process started)."""
    base = Path(workdir) / STATE_DIR
    try:
        text = (base / STATUS_FILE).read_text("utf-8")
    except FileNotFoundError:
        return LoopReading.unread("no status (never run here?)")
    except (OSError, UnicodeDecodeError) as exc:
        return LoopReading.unread(f"{STATUS_FILE}: {exc}")
    found = _object(text)
    if found is None:
        return LoopReading.unread(f"unreadable {STATUS_FILE}")
    status = status_file.parse(found, base / STATUS_FILE)
    alive = status_command.pid_alive(status["pid"])
    checked = status_file.checked(status, alive, (base / pause_control.CONTROL).exists())
    state = _object(_read(base / STATE_FILE))
    history = _read(base / HISTORY_FILE, TAIL_BYTES)
    ring = ""
    if detailed:
        segments = sorted((base / DIRECTORY).glob(SEGMENT_GLOB))[-2:]
        ring = "\n".join(_read(path, RING_BYTES) for path in segments)
    return _reading(checked, state, history, ring if detailed else None)


def read_remote(
    conn: connection.Connection, workdir: str, detailed: bool, timeout: float
) -> LoopReading:
    """A loop on another host: one shell command over its connection, within `timeout`."""
    where = f"{workdir.rstrip('/')}/{STATE_DIR}"
    ring = REMOTE_RING.format(directory=DIRECTORY, glob=SEGMENT_GLOB, bytes=REMOTE_RING_BYTES)
    command = REMOTE.format(
        dir=connection.remote_path(where),
        sep=SEP,
        lines=HISTORY_TAIL,
        history=HISTORY_FILE,
        ring=ring if detailed else "",
        pause=pause_control.CONTROL,
        status=STATUS_FILE,
        state=STATE_FILE,
    )
    result = conn.shell(command, timeout=timeout, max_output=REMOTE_OUTPUT)
    if result.timed_out:
        return LoopReading.unread(f"no answer within {timeout:g} s", reachable=False)
    if result.exit_code == connection.SSH_UNREACHABLE and isinstance(conn, connection.Ssh):
        lines = result.output.strip().splitlines()
        return LoopReading.unread(lines[-1] if lines else "ssh failed", reachable=False)
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
        return LoopReading.unread(f"no status at {where}/{STATUS_FILE}")
    found = _object("\n".join(status_lines))
    if found is None:
        return LoopReading.unread(f"unreadable status at {where}/{STATUS_FILE}")
    status = status_file.parse(found, Path(where) / STATUS_FILE)
    checked = status_file.checked(status, alive == "alive", pause_control.CONTROL in flags)
    state = _object("\n".join(parts[1]))
    ring_text = "\n".join(parts[3]) if detailed else None
    return _reading(checked, state, "\n".join(parts[2]), ring_text)


def _reading(
    status: CheckedStatus, state_json: JSONObject | None, history: str, ring: str | None
) -> LoopReading:
    try:
        state = State.from_dict(state_json or {})
    except ValueError:  # a state.json this ralph-run cannot read: the run will say so
        state = State()
    reading = LoopReading(
        status,
        history=_lines(history)[-HISTORY_TAIL:],
        death_time=state.death_times[-1] if state.death_times else None,
        failure=state.last_failure,
    )
    if ring is not None:
        entries = _lines(ring, keep=('"sample"', '"log"'))
        reading.samples = [e for e in entries if isinstance(e.get("sample"), dict)]
        logged = [line for e in entries if isinstance(line := e.get("log"), str)]
        reading.log = logged[-LOG_LINES:]
    return reading


def _read(path: Path, tail: int | None = None) -> str:
    try:
        with open(path, "rb") as file:
            if tail is not None:
                file.seek(max(0, os.fstat(file.fileno()).st_size - tail))
            return file.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _object(text: str) -> JSONObject | None:
    try:
        found: JSON = orjson.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _lines(text: str, keep: tuple[str, ...] = ()) -> list[JSONObject]:
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
def state_text(status: CheckedStatus, death_time: float | None, now: float) -> str:
    """What the loop does: paused, recovering (a death recorded, the status not rewritten by a
    step since), waiting for a usage limit's reset, running, pausing, dead, or how it ended."""
    if not status["running"]:
        ended = "dead" if status["status"] == "running" else status["status"] or "?"
        # a pause left behind holds the next run before its first iteration: r clears it
        return f"{ended}, paused" if status["pause_left"] else ended
    if status["paused"]:
        return "paused"
    if recovering(status, death_time):
        return f"recovering {durations.cell(now - death_time)}" if death_time else "recovering"
    if status["limited"] is not None:
        return f"limited {durations.cell(status['limited']['until'] - now)}"
    return status["pause"]["state"] if status["pause"] else "running"


def recovering(status: CheckedStatus, death_time: float | None) -> bool:
    """The last status write was the death's: the step it shows began before the death (every
    step after the recovery writes a later `step_started`, a new iteration none)."""
    last, started = status["last_death"], status["step_started"]
    if last is None or last["death"] != status["deaths"] or not death_time or started is None:
        return False
    return started < death_time <= status["updated"]


def cells(reading: LoopReading, now: float, stale: str | None = None) -> list[str]:
    """The row's cells after the loop's name: state, it, item, step, /h, deaths, d/t/s."""
    status = reading.status
    if status is None:
        what = stale or ("unreachable" if not reading.reachable else "no status")
        return [what, "", reading.error, "", "", "", ""]
    if stale:
        now = reading.wall  # the last known row, frozen as it was read
    item = status["item"] or ""
    if item:
        item += f" ({status['attempts'] + 1})"
    elif workers := status.get("workers"):  # loop.workers > 1: the details list each one
        doing = [w["item"] for w in workers if w["item"]]
        item = f"{len(doing)}/{len(workers)} workers" + (f": {', '.join(doing)}" if doing else "")
    pause = status["pause"]
    since = (pause["since"] if pause else None) if status["paused"] else status["step_started"]
    step = durations.cell(now - since) if status["running"] and since is not None else ""
    deaths = str(status["deaths"])  # the last one's fault: in the details' title
    if (rejuvenation := status.get("rejuvenation")) and rejuvenation["count"]:
        deaths += f" ♻{rejuvenation['count']}"  # restarts before a death: not deaths
    counts = f"{status.get('done', 0)}/{status.get('todo', 0)}/{status.get('skipped', 0)}"
    return [
        stale or state_text(status, reading.death_time, now),
        str(status["iteration"]),
        item,
        step,
        per_hour(reading.history, now if status["running"] else None),
        deaths,
        counts,
    ]


def per_hour(history: list[JSONObject], now: float | None) -> str:
    """Items done per hour: the done iterations that started in the hour before `now` (None: a
    loop that ended, up to its last iteration's end), over the time since the first of the
    iterations read in that hour (at least a minute)."""
    if now is None:
        ends = [
            started + seconds
            for line in history
            if isinstance(started := line.get("started"), int | float)
            and isinstance(seconds := line.get("seconds") or 0, int | float)
        ]
        if not ends:
            return ""
        now = max(ends)
    starts = [
        (started, line.get("outcome") == "done")
        for line in history
        if isinstance(started := line.get("started"), int | float) and started >= now - RATE_WINDOW
    ]
    if not starts:
        return ""
    done = sum(1 for _, was_done in starts if was_done)
    span = max(RATE_FLOOR, now - min(start for start, _ in starts))
    rate = done * 3600.0 / span
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.1f}"


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


def series(samples: list[JSONObject]) -> dict[str, list[float | None]]:
    """The engine's tokens/s (the generation counter's rate between samples), KV-cache use (%)
    and running / waiting requests, one value per sample, None where it had none."""
    found: dict[str, list[float | None]] = {"tok/s": [], "kv %": [], "run": [], "wait": []}
    previous: tuple[float, float] | None = None
    for entry in samples:
        sample = entry.get("sample")
        metrics = sample.get("metrics") if isinstance(sample, dict) else None
        metrics = metrics if isinstance(metrics, dict) else {}
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


def _number(value: JSON) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def engine_lines(samples: list[JSONObject] | None, width: int) -> list[Text]:
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


def iterations(lines: list[JSONObject], rows: int) -> RenderableType:
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
        if commit and isinstance(insertions := line.get("insertions"), int):
            changed = f"+{insertions} -{line.get('deletions') or 0}"
        table.add_row(
            str(line.get("iteration", "")),
            str(line.get("outcome", "")),
            durations.cell(seconds) if isinstance(seconds, int | float) else "",
            _tokens(line),
            str(commit)[:7] if commit else "-",
            changed,
            Text(printable(str(line.get("item", "")))),
        )
    return table


def _tokens(line: JSONObject) -> str:
    receipt = line.get("receipt")
    if isinstance(receipt, dict):
        return f"{_count(receipt.get('prompt_tokens'))}/{_count(receipt.get('generated_tokens'))}"
    prompt = line.get("prompt_tokens")
    return f"{_count(prompt)}/?" if isinstance(prompt, int) else ""


def _count(value: JSON) -> str:
    if not isinstance(value, int | float):
        return "?"
    return f"{value / 1000:.1f}k" if value >= 10_000 else str(int(value))


def output_lines(reading: LoopReading | None, rows: int) -> list[Text]:
    """The last output there is: the last failed attempt's (masked by the loop), else the
    server's log lines from the recorder's ring (masked by the recorder)."""
    if rows <= 0:
        return []
    if reading is None:
        return [Text("  output: reading...")]
    failure = reading.failure
    if failure and failure["output_tail"].strip():
        title = f"  last failed attempt's output ({printable(failure['item'])}):"
        text = failure["output_tail"].splitlines()
    elif reading.log:
        title, text = "  server log (recorder):", reading.log
    else:
        return [Text("  output: none recorded (no failed attempt, no recorder log)")]
    shown = [Text(title, no_wrap=True, overflow="ellipsis")]
    for line in text[-(rows - 1) :] if rows > 1 else []:
        shown.append(
            Text("    " + printable(line.expandtabs(4)), no_wrap=True, overflow="ellipsis")
        )
    return shown


def last_death_text(status: CheckedStatus) -> str:
    last = status["last_death"]
    if last is None:
        return ""
    when = last["time"]
    with contextlib.suppress(ValueError):
        when = datetime.fromisoformat(when).strftime("%H:%M:%S")
    return f"death {last['death']} at {when} in {last['phase']}: {last['fault']}"


def table(rows: list[tuple[str, list[str], str | None]]) -> Table:
    """The loops' table; each row is (name, cells, style). Every cell is plain text: an item
    such as "fix [/bold] route" is shown as it is, never read as rich markup."""
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
        grid.add_row(*(Text(printable(cell)) for cell in (name, *row_cells)), style=style)
    return grid


def details(
    title: str,
    reading: LoopReading | None,
    detailed: LoopReading | None,
    width: int,
    budget: int | None,
) -> list[RenderableType]:
    """Under the table, in `budget` lines (None: no limit): the selected loop's engine
    sparklines, its last iterations and its last output."""
    parts: list[RenderableType] = [Text(printable(title), no_wrap=True, overflow="ellipsis")]
    if reading is None or reading.status is None:
        return [*parts, Text(f"  {reading.error if reading else 'reading...'}")]
    engine = engine_lines(detailed.samples if detailed else None, width)
    engine += worker_lines(reading.status)
    history = reading.history
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


def worker_lines(status: CheckedStatus) -> list[Text]:
    """`loop.workers` > 1: each worker's item and step; `workers: auto`: the governor's last
    decision."""
    if not status["running"]:
        return []
    lines = []
    if governor := status.get("governor"):
        lines.append(Text(printable(
            f"  governor: {governor['workers']} of {governor['max_workers']} workers "
            f"({governor['reason']})"
        ), no_wrap=True, overflow="ellipsis"))  # fmt: skip
    for worker in status.get("workers", []):
        doing = worker["item"] or "idle"
        step = f"  ({worker['phase']})" if worker["item"] and worker["phase"] else ""
        line = Text(printable(f"  worker {worker['worker']}: {doing}{step}"), no_wrap=True)
        line.overflow = "ellipsis"
        lines.append(line)
    return lines
