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

import psutil

from ralph_runner.commands import options
from ralph_runner.errors import ExitCode, FatalError, Problem
from ralph_runner.fleet import status as fleet_status
from ralph_runner.loop import pause, state
from ralph_runner.output.text import printable
from ralph_runner.runbook import plan
from ralph_runner.workspace.state_files import STATE_DIR
from ralph_runner.workspace.status_file import (
    AgentBrokenStatus,
    CheckedStatus,
    HangBound,
    LastDeath,
    LastStart,
    LifecycleStatus,
    LimitedStatus,
    Pause,
    RejuvenationStatus,
    Status,
    checked,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run status`'s options."""
    options.loop_target(parser)
    options.each_host(
        parser, inventory_help="read every host's loop over its connection", timeout=10.0
    )
    parser.add_argument(
        "--json", action="store_true", help="status.json as one JSON object (with -i: a list)"
    )


def main(args: argparse.Namespace) -> int:
    if args.inventory:
        return fleet_main(args)
    workdir = workdir_of(args.target or ".")
    if not workdir.is_dir():  # as pause, resume and top say it: a typo, not "never run"
        raise FatalError(Problem("no such workdir", str(workdir)))
    status = state.Store(workdir).read_status()
    if status is None:
        print(
            f"ralph-run: no status in {workdir / STATE_DIR} (never run here?)",
            file=sys.stderr,
        )
        return ExitCode.PARTIAL
    # a pause left on a loop that is not running: the next run waits before its first iteration
    shown = checked(status, pid_alive(status["pid"]), pause.control_path(workdir).exists())
    if args.json:
        print(json.dumps(shown, ensure_ascii=False, sort_keys=True))
    else:
        print(printable("\n".join(human_lines(shown))))
    return 0


def fleet_main(args: argparse.Namespace) -> int:
    """Every host's loop, read at once over its connection; exit 1 when any cannot be read."""
    places = fleet_status.workdirs(args.target, args.inventory, args.limit)
    rows = fleet_status.read_all(args.inventory, places, args.timeout)
    if args.json:
        print(json.dumps(rows, ensure_ascii=False, sort_keys=True))
    else:
        print(printable("\n".join(fleet_status.table(rows))))
    return ExitCode.PARTIAL if any("error" in row for row in rows) else 0


def workdir_of(target: str) -> Path:
    """A directory is the workdir; a file is a runbook whose workdir is resolved as a run does."""
    path = Path(target)
    if path.is_file():
        return plan.build(path)[0].workdir
    return path.resolve()


def human_lines(status: CheckedStatus) -> list[str]:
    pid = status["pid"]
    if status["running"]:
        state_text = f"running (pid {pid})"
    elif status["status"] == "running":
        state_text = f"not running: pid {pid} is gone (killed?); run it again to resume"
    else:
        state_text = f"not running ({status['status'] or 'unknown'})"
    item = status["item"]
    phase = status["phase"]
    lines = [
        f"workdir:    {status['workdir'] or '?'}",
        f"status:     {state_text}",
        f"iterations: {status['iteration']}",
        _checklist(status),
        f"deaths:     {status['deaths']}" + _last_death(status["last_death"]),
        *_last_start(status["last_start"]),
    ]
    lines.extend(_rejuvenation(status.get("rejuvenation")))
    if item:
        lines.append(f"item:       {item}" + (f" ({phase})" if phase else ""))
    if status["running"]:  # loop.workers > 1: each worker's item; auto: the governor's say
        if governor := status.get("governor"):
            lines.append(
                f"governor:   {governor['workers']} of {governor['max_workers']} workers "
                f"({governor['reason']})"
            )
        for worker in status.get("workers", []):
            doing = worker["item"] or "idle"
            where = f" ({worker['phase']})" if worker["item"] and worker["phase"] else ""
            lines.append(f"worker {worker['worker']}:   {doing}{where}")
    lines.extend(_pause(status["pause"]) if status["running"] else _pause_left(status))
    if status["failure"]:  # why the run failed (exit 2): what its console said
        lines.append(f"error:      {status['failure']}")
    if aside := status.get("set_aside"):  # items whose prompts killed the server
        names = ", ".join(repr(i) for i in aside)
        lines.append(f"set aside:  {len(aside)}, the cause of their deaths: {names}")
    lines.extend(_agent_broken(status["agent_broken"]))
    lines.extend(_limited(status["limited"]))
    lines.extend(_hang_bound(status["hang_bound"]) if status["running"] else [])
    lines.extend(_lifecycle(status.get("lifecycle")))
    if status["updated"]:  # 0: a file without it
        updated = datetime.fromtimestamp(status["updated"]).astimezone()
        lines.append(f"updated:    {updated.isoformat(timespec='seconds')}")
    return lines


def _checklist(status: Status) -> str:
    if "done" not in status:  # the run failed before it could read the checklist
        return "checklist:  not read"
    return (
        f"checklist:  {status.get('done', 0)} done, {status.get('todo', 0)} todo, "
        f"{status.get('skipped', 0)} skipped"
    )


def _hang_bound(bound: HangBound | None) -> list[str]:
    """The hang bound the progress probe computed last (docs: hangs, "The hang bound")."""
    if bound is None:
        return []
    return [f"hang bound: {bound['seconds']:g} s without an engine step ({bound['why'] or '?'})"]


def _lifecycle(lifecycle: LifecycleStatus | None) -> list[str]:
    """The runbook's `setup:` and `teardown:` blocks (docs: writing runbooks, "A GPU shared
    through a scheduler"): how far they ran, and what a run killed before its teardown left."""
    if lifecycle is None:
        return []
    said = [
        f"setup {lifecycle['setup'] or 'not run'}",
        f"teardown {lifecycle['teardown'] or 'not run'}",
    ]
    if lifecycle["held"]:
        said.append("what setup acquired is held until teardown")
    lines = [f"lifecycle:  {', '.join(said)}"]
    if lifecycle["error"]:
        lines.append(f"            {lifecycle['error']}")
    left = lifecycle["left_by_last_run"]
    if left is not None:
        since = left["since"]
        when = "?" if since is None else datetime.fromtimestamp(since).astimezone()
        shown = when if isinstance(when, str) else when.isoformat(timespec="seconds")
        lines.append(
            f"            the last run (pid {left['pid'] or '?'}, setup at {shown}) ended "
            "without its teardown"
        )
    return lines


def _pause(pause: Pause | None) -> list[str]:
    """`ralph-run pause`: waiting, or about to (the step in hand finishes first)."""
    if pause is None:
        return []
    if pause["state"] == "paused" and pause["since"] is not None:
        since = datetime.fromtimestamp(pause["since"]).astimezone().isoformat(timespec="seconds")
        killed = f", {pause['killed_step']} stopped" if pause["killed_step"] else ""
        steps = _block(pause, "pause")
        return [f"pause:      paused since {since}{killed}{steps} (`ralph-run resume` goes on)"]
    if pause["state"] == "resuming":
        return [f"pause:      resuming{_block(pause, 'resume')}"]
    when = "stopping the step now" if pause["now"] else "after the iteration in hand"
    return [f"pause:      pausing {when}"]


def _pause_left(status: CheckedStatus) -> list[str]:
    """`.ralph/pause` left behind by a loop that ended (or was stopped) while paused."""
    if not status["pause_left"]:
        return []
    return [
        "pause:      paused (the loop is not running): the next run waits before its first "
        "iteration; `ralph-run resume` clears it"
    ]


def _block(pause: Pause, which: str) -> str:
    """The runbook's `pause:` (or `resume:`) block: " (pause steps done)", or why it failed."""
    steps = pause["steps"]
    if steps is None:
        return ""  # the runbook has none
    if steps == "failed":
        return f" ({which} steps failed: {pause['steps_error']})"
    return f" ({which} steps {steps})"


def _limited(limited: LimitedStatus | None) -> list[str]:
    """The agent's usage limit the loop waits for, or the one that stopped it (exit 7)."""
    if limited is None:
        return []
    until = datetime.fromtimestamp(limited["until"]).astimezone().isoformat(timespec="seconds")
    return [f"limited:    until {until} ({limited['source']}: {limited['line']})"]


def _agent_broken(broken: AgentBrokenStatus | None) -> list[str]:
    """Why the loop stopped with exit 6, and the items it skipped before it saw it."""
    if broken is None:
        return []
    items = " and ".join(repr(i) for i in broken["items"])
    lines = [f"agent:      broken: {broken['reason']} (the same failure on {items})"]
    skipped = broken["skipped"]
    if skipped:
        names = ", ".join(repr(i) for i in skipped)
        lines.append(f"skipped:    {names} (while the agent was broken; '- [ ]' retries them)")
    return lines


def _last_start(start: LastStart | None) -> list[str]:
    """The service was not running at the run's first check and the loop started it."""
    if start is None:
        return []
    done = (
        f"started in {start['seconds']} s"
        if start["recovered"]
        else f"its start failed: {start['reason']}"
    )
    return [f"start:      the service was not running at {start['time']}: {done}"]


def _rejuvenation(rejuvenation: RejuvenationStatus | None) -> list[str]:
    """health.rejuvenate: restarts before a death (no death), the last one, one due now."""
    if rejuvenation is None:
        return []
    by = ", ".join(f"{sign} {n}" for sign, n in rejuvenation["by_sign"].items())
    line = f"rejuvenated: {rejuvenation['count']}" + (f" ({by})" if by else "")
    if last := rejuvenation["last"]:
        when = datetime.fromtimestamp(last["time"]).astimezone().isoformat(timespec="seconds")
        done = "restarted" if last["recovered"] else "NOT restarted"
        line += f"; last {when}: {last['found']}: {done} in {last['seconds']:g} s"
    lines = [line]
    if rejuvenation["due"]:
        signs = ", ".join(rejuvenation["due"])
        lines.append(f"rejuvenate: due at the next item boundary ({signs})")
    return lines


def _last_death(death: LastDeath | None) -> str:
    if death is None:
        return ""
    return f" (last: {death['time'] or '?'} at {death['phase'] or '?'}: {death['reason']})"


def pid_alive(pid: int | None) -> bool:
    """The pid still runs (a zombie waiting for its parent counts as gone)."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError):  # ValueError: a negative pid
        return False
