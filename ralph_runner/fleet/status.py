"""`ralph-run status -i INVENTORY`: every host's loop, read over the host's own connection.

Each host runs its own loop (deployed by deploy/playbook.yml), so its `.ralph/status.json`
lies on that host. All hosts are read at once, each under `timeout` seconds, so one host that
does not answer says "unreachable" and never holds up the table. Where the loop lives on each
host: the runbook's `workdir` rendered with that host's variables, or a directory given on the
command line (a template too: `/srv/ralph/{{ inventory_hostname }}`), or, by default, the host
variable `ralph_workdir` that the deploy playbook sets.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NotRequired, TypedDict, final

from ralph_runner import templating
from ralph_runner.durable.json_value import JSON
from ralph_runner.errors import FatalError, Problem
from ralph_runner.loop import pause
from ralph_runner.output import durations
from ralph_runner.output.text import columns
from ralph_runner.process import connection
from ralph_runner.runbook import inventory, plan
from ralph_runner.workspace import status_file
from ralph_runner.workspace.state_files import STATE_DIR
from ralph_runner.workspace.status_file import STATUS_FILE, CheckedStatus

DEFAULT_WORKDIR = "{{ ralph_workdir | default('.') }}"
READ_STATUS = (  # one round trip: the status file, then whether its pid still runs there
    # and whether a pause is asked for (`.ralph/pause`: left on a loop that is not running, it
    # holds the next run before its first iteration)
    "cat -- {file} && pid=$(sed -n 's/.*\"pid\": *\\([0-9][0-9]*\\).*/\\1/p' {file} | head -n 1)"
    ' && printf "\\n%s%s\\n" "$( [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo alive'
    ' || echo gone)" "$( [ -e {pause} ] && echo " pause")"'
)


@final  # final: `"error" in row` tells the two apart
class HostStatus(CheckedStatus):
    """One host's loop as `status -i` shows it (and prints it with --json)."""

    host: str
    workdir: str
    seconds: float  # the read's round trip
    reachable: bool


@final
class HostError(TypedDict):
    """One host whose status could not be read, and why."""

    host: str
    workdir: NotRequired[str]  # absent: the host's connection could not be made
    seconds: NotRequired[float]
    reachable: bool  # False: no answer; True: an answer without a status
    error: str


HostAnswer = HostStatus | HostError


def workdirs(target: str | None, inventory_path: str, limit: str | None) -> dict[str, str]:
    """Host -> the directory of its loop, as that host sees it."""
    if target and Path(target).is_file():  # a runbook: its workdir, rendered per host
        plans = plan.build(target, inventory_path, limit)
        return {p.host: _remote_form(p) for p in plans}
    inv = inventory.load(inventory_path)
    hosts = inv.select(limit or "all", where=Problem("", path="--limit"))
    cwd = Path.cwd()
    templar = templating.Templar(cwd, cwd=cwd)
    found = {}
    for host in hosts:
        variables = {**inv.host_vars(host), "inventory_hostname": host}
        where = Problem("", path="status target")
        found[host] = templar.render(target or DEFAULT_WORKDIR, variables, where=where)
    return found


def read_all(inventory_path: str, places: dict[str, str], timeout: float) -> list[HostAnswer]:
    inv = inventory.load(inventory_path)

    def one(host: str) -> HostAnswer:
        try:
            conn = connection.for_host({**inv.host_vars(host), "inventory_hostname": host})
        except FatalError as exc:
            return {"host": host, "reachable": False, "error": str(exc.problems[0])}
        return read_one(host, conn, places[host], timeout)

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(places)))) as pool:
        return list(pool.map(one, places))


def read_one(host: str, conn: connection.Connection, workdir: str, timeout: float) -> HostAnswer:
    """One host's status, or why it could not be read; never raises, never outlives timeout."""
    started = time.monotonic()
    status_path = f"{workdir.rstrip('/')}/{STATE_DIR}/{STATUS_FILE}"
    pause_file = f"{workdir.rstrip('/')}/{STATE_DIR}/{pause.CONTROL}"
    quoted, pause_quoted = (connection.remote_path(path) for path in (status_path, pause_file))
    result = conn.shell(READ_STATUS.format(file=quoted, pause=pause_quoted), timeout=timeout)
    seconds = round(time.monotonic() - started, 3)
    if result.timed_out:
        return _unread(host, workdir, seconds, False, f"no answer within {timeout:g} s")
    if result.exit_code == connection.SSH_UNREACHABLE and isinstance(conn, connection.Ssh):
        lines = result.output.strip().splitlines()
        return _unread(host, workdir, seconds, False, lines[-1] if lines else "ssh failed")
    if result.exit_code != 0:
        return _unread(host, workdir, seconds, True, f"no status at {status_path}")
    text, _, liveness = result.output.rstrip("\n").rpartition("\n")
    try:
        found: JSON = json.loads(text)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return _unread(host, workdir, seconds, True, f"unreadable status at {status_path}")
    alive, *flags = liveness.split() or ["gone"]
    status = status_file.checked(
        status_file.parse(found, Path(status_path)), alive == "alive", "pause" in flags
    )
    return {**status, "host": host, "workdir": workdir, "seconds": seconds, "reachable": True}


def _unread(host: str, workdir: str, seconds: float, reachable: bool, error: str) -> HostError:
    return {
        "host": host,
        "workdir": workdir,
        "seconds": seconds,
        "reachable": reachable,
        "error": error,
    }


def table(rows: list[HostAnswer]) -> list[str]:
    header = ("host", "state", "iter", "done", "todo", "skipped", "deaths", "last death", "updated")
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        if "error" in row:
            state = "unreachable" if not row["reachable"] else "no status"
            lines.append((row["host"], f"{state}: {row['error']}", *[""] * 7))
            continue
        state = "running" if row["running"] else row["status"] or "?"
        if row["running"] and row["paused"]:
            state = "paused"
        if not row["running"] and row["status"] == "running":
            state = "dead (was running)"
        if row["pause_left"]:  # `ralph-run resume` clears it
            state += ", paused"
        last = row["last_death"]
        lines.append(
            (
                row["host"],
                state,
                str(row["iteration"]),
                str(row.get("done", 0)),
                str(row.get("todo", 0)),
                str(row.get("skipped", 0)),
                str(row["deaths"]),
                f"{last['time']} {last['phase']}".strip() if last else "-",
                durations.ago(row["updated"]),
            )
        )
    return columns(lines)


def _remote_form(p: plan.Plan) -> str:
    """A plan's workdir as text for its host: local hosts get the resolved path; remote ones
    the runbook's rendered `workdir` as written (relative = from the remote login directory)."""
    conn = p.connection_for(None)
    if not isinstance(conn, connection.Ssh):
        return str(p.workdir)
    where = p.runbook.where(("workdir",))
    return p.templar.render(p.model.workdir, p.variables, where=where)
