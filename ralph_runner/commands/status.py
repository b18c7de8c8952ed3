"""`ralph-run status [WORKDIR|RUNBOOK]`: where a loop stands, for a person or a cron job.

It reads `.ralph/status.json` only, so it works while the loop runs and after it ended. A status
that says "running" whose pid is gone means the run was killed (SIGKILL, a reboot): it is shown
as not running, and the next `ralph-run RUNBOOK` resumes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from ralph_runner.errors import ExitCode
from ralph_runner.fleet import status as fleet_status
from ralph_runner.loop import pause, state
from ralph_runner.runbook import plan
from ralph_runner.workspace.state_files import STATE_DIR


def main(args: argparse.Namespace) -> int:
    if args.inventory:
        return fleet_main(args)
    workdir = workdir_of(args.target or ".")
    status = state.Store(workdir).read_status()
    if status is None:
        print(
            f"ralph-run: no status in {workdir / STATE_DIR} (never run here?)",
            file=sys.stderr,
        )
        return ExitCode.PARTIAL
    status["running"] = bool(status.get("running")) and pid_alive(status.get("pid"))
    # a pause left on a loop that is not running: the next run waits before its first iteration
    status["pause_left"] = not status["running"] and pause.control_path(workdir).exists()
    if args.json:
        print(json.dumps(status, ensure_ascii=False, sort_keys=True))
    else:
        print("\n".join(human_lines(status)))
    return 0


def fleet_main(args: argparse.Namespace) -> int:
    """Every host's loop, read at once over its connection; exit 1 when any cannot be read."""
    places = fleet_status.workdirs(args.target, args.inventory, args.limit)
    rows = fleet_status.read_all(args.inventory, places, args.timeout)
    if args.json:
        print(json.dumps(rows, ensure_ascii=False, sort_keys=True))
    else:
        print("\n".join(fleet_status.table(rows)))
    return ExitCode.PARTIAL if any("error" in row for row in rows) else 0


def workdir_of(target: str) -> Path:
    """A directory is the workdir; a file is a runbook whose workdir is resolved as a run does."""
    path = Path(target)
    if path.is_file():
        return plan.build(path)[0].workdir
    return path.resolve()


def human_lines(status: dict[str, Any]) -> list[str]:
    pid = status.get("pid")
    if status["running"]:
        state_text = f"running (pid {pid})"
    elif status.get("status") == "running":
        state_text = f"not running: pid {pid} is gone (killed?); run it again to resume"
    else:
        state_text = f"not running ({status.get('status', 'unknown')})"
    item = status.get("item")
    phase = status.get("phase")
    lines = [
        f"workdir:    {status.get('workdir', '?')}",
        f"status:     {state_text}",
        f"iterations: {status.get('iteration', 0)}",
        _checklist(status),
        f"deaths:     {status.get('deaths', 0)}" + _last_death(status.get("last_death")),
        *_last_start(status.get("last_start")),
    ]
    if item:
        lines.append(f"item:       {item}" + (f" ({phase})" if phase else ""))
    lines.extend(_pause(status) if status["running"] else _pause_left(status))
    if status.get("failure"):  # why the run failed (exit 2): what its console said
        lines.append(f"error:      {status['failure']}")
    lines.extend(_agent_broken(status.get("agent_broken")))
    lines.extend(_limited(status.get("limited")))
    lines.extend(_hang_bound(status.get("hang_bound")) if status["running"] else [])
    if isinstance(status.get("updated"), int | float):
        updated = datetime.fromtimestamp(status["updated"]).astimezone()
        lines.append(f"updated:    {updated.isoformat(timespec='seconds')}")
    return lines


def _checklist(status: dict[str, Any]) -> str:
    if "done" not in status:  # the run failed before it could read the checklist
        return "checklist:  not read"
    return (
        f"checklist:  {status.get('done', 0)} done, {status.get('todo', 0)} todo, "
        f"{status.get('skipped', 0)} skipped"
    )


def _hang_bound(bound: Any) -> list[str]:
    """The hang bound the progress probe computed last (docs: hangs, "The hang bound")."""
    if not isinstance(bound, dict) or not isinstance(bound.get("seconds"), int | float):
        return []
    return [f"hang bound: {bound['seconds']:g} s without an engine step ({bound.get('why', '?')})"]


def _pause(status: dict[str, Any]) -> list[str]:
    """`ralph-run pause`: waiting, or about to (the step in hand finishes first)."""
    pause = status.get("pause")
    if not isinstance(pause, dict):
        return []
    if pause.get("state") == "paused" and isinstance(pause.get("since"), int | float):
        since = datetime.fromtimestamp(pause["since"]).astimezone().isoformat(timespec="seconds")
        killed = f", {pause['killed_step']} stopped" if pause.get("killed_step") else ""
        steps = _block(pause, "pause")
        return [f"pause:      paused since {since}{killed}{steps} (`ralph-run resume` goes on)"]
    if pause.get("state") == "resuming":
        return [f"pause:      resuming{_block(pause, 'resume')}"]
    when = "stopping the step now" if pause.get("now") else "after the iteration in hand"
    return [f"pause:      pausing {when}"]


def _pause_left(status: dict[str, Any]) -> list[str]:
    """`.ralph/pause` left behind by a loop that ended (or was stopped) while paused."""
    if not status.get("pause_left"):
        return []
    return [
        "pause:      paused (the loop is not running): the next run waits before its first "
        "iteration; `ralph-run resume` clears it"
    ]


def _block(pause: dict[str, Any], which: str) -> str:
    """The runbook's `pause:` (or `resume:`) block: " (pause steps done)", or why it failed."""
    steps = pause.get("steps")
    if steps not in ("running", "done", "failed"):
        return ""  # the runbook has none
    if steps == "failed":
        return f" ({which} steps failed: {pause.get('steps_error')})"
    return f" ({which} steps {steps})"


def _limited(limited: Any) -> list[str]:
    """The agent's usage limit the loop waits for, or the one that stopped it (exit 7)."""
    if not isinstance(limited, dict) or not isinstance(limited.get("until"), int | float):
        return []
    until = datetime.fromtimestamp(limited["until"]).astimezone().isoformat(timespec="seconds")
    return [f"limited:    until {until} ({limited.get('source')}: {limited.get('line')})"]


def _agent_broken(broken: Any) -> list[str]:
    """Why the loop stopped with exit 6, and the items it skipped before it saw it."""
    if not isinstance(broken, dict):
        return []
    items = " and ".join(repr(i) for i in broken.get("items") or [])
    lines = [f"agent:      broken: {broken.get('reason')} (the same failure on {items})"]
    skipped = broken.get("skipped") or []
    if skipped:
        names = ", ".join(repr(i) for i in skipped)
        lines.append(f"skipped:    {names} (while the agent was broken; '- [ ]' retries them)")
    return lines


def _last_start(start: Any) -> list[str]:
    """The service was not running at the run's first check and the loop started it."""
    if not isinstance(start, dict):
        return []
    done = (
        f"in {start.get('seconds')} s"
        if start.get("recovered")
        else f"failed: {start.get('reason')}"
    )
    return [f"started:    the service was not running at {start.get('time')}: started {done}"]


def _last_death(death: Any) -> str:
    if not isinstance(death, dict):
        return ""
    return f" (last: {death.get('time', '?')} at {death.get('phase', '?')}: {death.get('reason')})"


def pid_alive(pid: Any) -> bool:
    """The pid still runs (a zombie waiting for its parent counts as gone)."""
    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return False
