"""`ralph-run pause|resume -i INVENTORY`: the pause control file written on every host.

Each host's loop looks at its own `.ralph/pause` (loop/pause.py), so the file is written (or
removed) over the host's connection, local or OpenSSH, as `status -i` reads status.json: all
hosts at once, each within `timeout` seconds, one that does not answer is "unreachable".
Written atomically on the host: a temp file in `.ralph/`, then `mv`.
"""

from __future__ import annotations

import shlex
from concurrent.futures import ThreadPoolExecutor
from typing import NotRequired, TypedDict

from ralph_runner.errors import FatalError
from ralph_runner.loop import pause
from ralph_runner.process import connection
from ralph_runner.runbook import inventory
from ralph_runner.workspace.state_files import STATE_DIR

PAUSE = (  # a request already there is kept (its time, its author) unless --now adds "now"
    'd={dir}; [ -d "$d" ] || {{ echo "no such workdir: $d"; exit 3; }}; '
    'if [ -e "$d/{state}/{name}" ] && [ {now} = 0 ]; then'
    " echo 'already paused or pausing'; exit 0; fi; "
    'mkdir -p "$d/{state}" && printf "%s" {text} > "$d/{state}/.{name}.ralph-tmp"'
    ' && mv -f "$d/{state}/.{name}.ralph-tmp" "$d/{state}/{name}" && echo \'pause asked for\''
)
RESUME = (
    'd={dir}; [ -d "$d" ] || {{ echo "no such workdir: $d"; exit 3; }}; '
    'if [ -e "$d/{state}/{name}" ]; then rm -f "$d/{state}/{name}" && echo resumed;'
    " else echo 'not paused'; fi"
)


class Answer(TypedDict):
    """One host's answer (`pause -i --json` prints them): what it said, or the error."""

    host: str
    workdir: str
    said: NotRequired[str]  # "pause asked for", "resumed", ...
    error: NotRequired[str]  # unreachable, no such workdir, ...


def command(action: str, workdir: str, now: bool = False) -> str:
    """The shell that pauses or resumes the loop of `workdir` on its host."""
    quoted = connection.remote_path(workdir)
    template = PAUSE if action == "pause" else RESUME
    text = shlex.quote(pause.request_text(now)) if action == "pause" else ""
    return template.format(dir=quoted, state=STATE_DIR, name=pause.CONTROL, text=text, now=int(now))


def send_one(
    host: str, conn: connection.Connection, workdir: str, action: str, now: bool, timeout: float
) -> Answer:
    """One host's answer: {host, workdir, said} or {host, workdir, error}; never raises."""
    result = conn.shell(command(action, workdir, now), timeout=timeout)
    lines = result.output.strip().splitlines()
    if result.timed_out:
        error = f"unreachable: no answer within {timeout:g} s"
    elif result.exit_code == connection.SSH_UNREACHABLE and isinstance(conn, connection.Ssh):
        error = "unreachable: " + (lines[-1] if lines else "ssh failed")
    elif result.exit_code != 0:
        error = lines[-1] if lines else f"exit {result.exit_code}"
    else:
        return {"host": host, "workdir": workdir, "said": lines[-1] if lines else action}
    return {"host": host, "workdir": workdir, "error": error}


def send_all(
    inventory_path: str, places: dict[str, str], action: str, now: bool, timeout: float
) -> list[Answer]:
    inv = inventory.load(inventory_path)

    def one(host: str) -> Answer:
        try:
            conn = connection.for_host({**inv.host_vars(host), "inventory_hostname": host})
        except FatalError as exc:
            return {"host": host, "workdir": places[host], "error": str(exc.problems[0])}
        return send_one(host, conn, places[host], action, now, timeout)

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(places)))) as pool:
        return list(pool.map(one, places))
