"""`ralph-run pause [WORKDIR|RUNBOOK] [--now]`: hold a running loop before its next iteration.

It writes the control file `.ralph/pause` (loop/pause.py says what the loop does with it);
`ralph-run resume` removes it. With `-i INVENTORY`, on every host the pattern matches, over the
host's connection (fleet/control.py). Exit 1 when any host could not be reached.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ralph_runner.commands import options, status
from ralph_runner.errors import ExitCode
from ralph_runner.fleet import control
from ralph_runner.fleet import status as fleet_status
from ralph_runner.loop import pause, state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run pause`'s options."""
    options.loop_target(parser)
    parser.add_argument(
        "--now",
        action="store_true",
        help="stop the running step now (as SIGTERM does, no strike) instead of letting the "
        "iteration finish",
    )
    options.loop_control(parser)


def main(args: argparse.Namespace) -> int:
    return control_main(args, "pause")


def control_main(args: argparse.Namespace, action: str) -> int:
    now = bool(getattr(args, "now", False))
    if args.inventory:
        places = fleet_status.workdirs(args.target, args.inventory, args.limit)
        rows = control.send_all(args.inventory, places, action, now, args.timeout)
        if args.json:
            print(json.dumps(rows, ensure_ascii=False, sort_keys=True))
        else:
            for row in rows:
                said = row.get("said") or f"error: {row.get('error')}"
                print(f"{row['host']}: {row['workdir']}: {said}")
        return ExitCode.PARTIAL if any("error" in row for row in rows) else 0
    workdir = status.workdir_of(args.target or ".")
    found = state.Store(workdir).read_status() if workdir.is_dir() else None
    running = found is not None and found["running"] and status.pid_alive(found["pid"])
    if action == "pause":
        said = _pause(workdir, now, running, found is not None and found["paused"])
    else:
        said = "resumed" if pause.release(workdir) else "not paused"
    if args.json:
        print(json.dumps({"workdir": str(workdir), "said": said, "running": running}))
        return 0
    print(f"{workdir}: {said}: {_meaning(action, said, now, running)}")
    return 0


def _pause(workdir: Path, now: bool, running: bool, paused: bool) -> str:
    """Write the request, unless one is there already (kept: its time and author; a `--now`
    replaces a plain one, to stop the step in hand)."""
    wanted = pause.read(pause.control_path(workdir)) if workdir.is_dir() else None
    if wanted is None or (now and not wanted.get("now")):
        pause.request(workdir, now)  # a missing workdir: "no such workdir", exit 2
        return "pause asked for"
    return "already paused" if paused or not running else "pause already asked for"


def _meaning(action: str, said: str, now: bool, running: bool) -> str:
    if action == "resume":
        if said == "not paused":
            return "no pause was asked for"
        return "the loop goes on within a second" if running else "no loop runs there now"
    if said == "already paused":
        if running:
            return "the loop waits; `ralph-run resume` lets it go on"
        return (
            "the loop is not running: the next run waits before its first iteration; "
            "`ralph-run resume` clears it"
        )
    if said == "pause already asked for":
        return "the loop waits after the iteration in hand; `ralph-run resume` lets it go on"
    if not running:
        return "no loop runs there now: the next run waits before its first iteration"
    if now:
        return "the running step is stopped now (no strike); the loop waits"
    return "the loop waits after the iteration in hand; `ralph-run resume` lets it go on"
