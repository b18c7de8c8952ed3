"""Every matching host at once: one `ralph-run` process per host, at most `--forks` at a time.

One loop per process, as Ansible forks one worker per host: a crash or a give-up on one host
never stops another, and each child is exactly the single-host run (its own workdir, state,
lock, death log). The children speak `--json`; each line comes back here as its typed event
(events.from_json: a kind this ralph-run does not know is passed on as it is) with `host` set,
so the console (or this process's own `--json`) carries the host on every line, and the run
ends with one row per host. The exit code is the worst of the hosts' (WORST_FIRST).
SIGTERM/SIGINT stop every loop through `execute.kill_all`: each child saves its state and
takes its agent down within CHILD_GRACE, then anything left is killed.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ralph_runner import events
from ralph_runner.errors import ExitCode, FatalError, Interrupted
from ralph_runner.output.bus import EventBus
from ralph_runner.process import execute
from ralph_runner.runbook.plan import Plan

CHILD_GRACE = 15.0  # seconds a child gets after SIGTERM to save its state and stop its agent
# Most severe first: the fleet exits with the first of these that any host exited with. An
# interrupt beats everything; then what needs a person (a crash, a bad runbook, a service that
# could not be recovered, a broken agent); then a usage limit to come back after; then a lock
# held elsewhere; then max_iterations.
WORST_FIRST = (
    ExitCode.SIGTERM,
    ExitCode.SIGINT,
    ExitCode.INTERNAL,
    ExitCode.INVALID,
    ExitCode.GAVE_UP,
    ExitCode.AGENT_BROKEN,
    ExitCode.LIMITED,
    ExitCode.HELD,
    ExitCode.MAX_ITERATIONS,
)


@dataclass
class HostRun:
    """What one host's loop said: its last summary and its exit code."""

    host: str
    code: int | None = None
    summary: events.Summary | None = None
    deaths: int = 0
    _partial: str = ""

    def row(self) -> events.HostRow:
        s = self.summary
        return {
            "host": self.host,
            "done": s.done if s else None,
            "todo": s.todo if s else None,
            "skipped": s.skipped if s else None,
            "deaths": s.deaths if s else self.deaths,
            "exit_code": self.code,
        }


def child_argv(args: Any, host: str) -> list[str]:
    """The single-host run of `host`, as the operator would type it, speaking JSON."""
    argv = [sys.executable, "-m", "ralph_runner", args.runbook, "--limit", host, "--json"]
    if args.inventory:
        argv += ["-i", args.inventory]
    for extra in args.extra_vars:
        argv += ["-e", extra]
    return argv + ["-v"] * args.verbose


def worst(codes: list[int]) -> int:
    for code in WORST_FIRST:
        if code in codes:
            return code
    return max(codes, default=0)  # another non-zero code (a custom recovery.exit_code) or 0


def check_distinct(plans: list[Plan]) -> None:
    """Loops on one controller must not share a workdir: they would fight for its lock."""
    seen: dict[Path, str] = {}
    for p in plans:
        if p.workdir in seen:
            where = p.runbook.where(("workdir",))
            message = (
                f"hosts {seen[p.workdir]!r} and {p.host!r} resolve to the same workdir "
                f"{p.workdir}: template it, e.g. workdir: work/{{{{ inventory_hostname }}}}"
            )
            raise FatalError(replace(where, message=message))
        seen[p.workdir] = p.host


def run(plans: list[Plan], args: Any, output: EventBus) -> int:
    check_distinct(plans)
    hosts = [HostRun(p.host) for p in plans]
    stop = threading.Event()
    output.emit(events.Fleet(hosts=[h.host for h in hosts], forks=args.forks))

    def one(host: HostRun) -> None:
        result = execute.run(
            child_argv(args, host.host),
            cancel=stop,  # a host not started yet is not started; a running one gets the grace
            on_output=_reader(host, output),
            grace=CHILD_GRACE,
        )
        _flush(host, output)
        host.code = result.exit_code  # None: stopped by a signal (or never started)
        output.emit(events.HostDone(host=host.host, exit_code=host.code))

    interrupted: Interrupted | None = None
    with ThreadPoolExecutor(max_workers=args.forks, thread_name_prefix="host") as pool:
        futures = [pool.submit(one, host) for host in hosts]
        try:
            with execute.InterruptsRaise(CHILD_GRACE, on_signal=stop.set):
                for future in futures:
                    future.result()
        except Interrupted as exc:
            interrupted = exc
            for future in futures:
                future.result()
    signalled = interrupted.exit_code if interrupted else ExitCode.SIGTERM
    for host in hosts:
        host.code = signalled if host.code is None else host.code
    rows = [h.row() for h in hosts]
    code = worst([h.code for h in hosts if h.code is not None])
    output.emit(events.FleetSummary(hosts=rows, exit_code=code))
    return code


def _reader(host: HostRun, output: EventBus) -> Callable[[str], None]:
    """The child's output, a line at a time: JSON events re-emitted with the host."""

    def read(text: str) -> None:
        *lines, host._partial = (host._partial + text).split("\n")
        for line in lines:
            _emit(host, output, line)

    return read


def _flush(host: HostRun, output: EventBus) -> None:
    if host._partial:
        _emit(host, output, host._partial)
        host._partial = ""


def _emit(host: HostRun, output: EventBus, line: str) -> None:
    if not line.strip():
        return
    try:
        data = json.loads(line)
    except ValueError:
        data = None
    if not isinstance(data, dict) or "event" not in data:
        output.emit(events.HostSays(host=host.host, text=line))  # e.g. an error on stderr
        return
    event = replace(events.from_json(data), host=host.host)
    if isinstance(event, events.Summary):
        host.summary = event
    elif isinstance(event, events.Death):
        host.deaths = max(host.deaths, event.death)
    output.emit(event)
