"""The command and process probes against real processes: a command's exit and timeout (its
tree killed), a pidfile, a name and a command line, a zombie, and ralph-run never finding
itself."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from probe_helpers import probe
from pydantic import ValidationError
from support.standin import wait_for

from ralph_runner import probes

pytestmark = pytest.mark.usefixtures("nothing_left_behind")


# command


def test_command_ok_and_failing(client, connection):
    ok = probe("command", "echo ready", client, connection)
    failed = probe("command", "echo 'engine dead' >&2; exit 3", client, connection)

    assert ok.ok and ok.detail == "exit 0: ready"
    assert (failed.ok, failed.reason, failed.detail) == (False, "status", "exit 3: engine dead")


def test_command_timeout_kills_it(client, connection, tmp_path):
    marker = tmp_path / "sleeper"
    command = f"exec -a {marker} sleep 30"

    result = probe("command", command, client, connection, timeout=0.5)

    assert (result.ok, result.reason) == (False, "timeout")
    assert result.detail.startswith("timed out after 0.5s")
    assert result.seconds < 3.0
    wait_for(lambda: not _running(str(marker)), 5, "the timed-out command to be gone")


def _running(text: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if text in cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


# process


def test_process_by_pidfile_alive_then_dead(sleeper, client):
    child, pidfile, name = sleeper

    alive = probe("process", {"pidfile": str(pidfile)}, client)
    child.kill()
    child.wait(5)
    dead = probe("process", {"pidfile": str(pidfile)}, client)

    assert alive.ok and alive.detail == f"pid {child.pid} ({name}) is running"
    assert (dead.ok, dead.reason) == (False, "refused")
    assert str(child.pid) in dead.detail


def test_process_pidfile_missing_or_garbage(tmp_path, client):
    missing = probe("process", {"pidfile": str(tmp_path / "none.pid")}, client)
    (tmp_path / "bad.pid").write_text("not a pid")
    garbage = probe("process", {"pidfile": str(tmp_path / "bad.pid")}, client)

    assert (missing.reason, garbage.reason) == ("refused", "error")
    assert "missing" in missing.detail and "not a pid" in garbage.detail


def test_process_by_name_and_cmdline(sleeper, client):
    child, _, name = sleeper

    by_name = probe("process", {"name": name}, client)
    both = probe("process", {"name": name, "cmdline": rf"{name} 30$"}, client)
    wrong = probe("process", {"name": name, "cmdline": f"{name} 31"}, client)

    assert by_name.ok and both.ok
    assert f"pid {child.pid}" in by_name.detail
    assert (wrong.ok, wrong.reason) == (False, "refused")


def test_process_zombie_does_not_count(sleeper, client):
    child, pidfile, _ = sleeper
    child.kill()
    wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 5, "a zombie")

    result = probe("process", {"pidfile": str(pidfile)}, client)

    assert (result.ok, result.reason) == (False, "refused")


# The probe in a process of its own, whose command line its pattern matches: a token of the
# test's own makes it the only one (pytest-xdist's workers share one command line).
SELF_PROBE = """
import re
import httpx, psutil
from ralph_runner import probes
from ralph_runner.probes import ProbeContext, run_probe
from ralph_runner.process.connection import for_host
own = re.escape(" ".join(psutil.Process().cmdline()))
params = probes.KINDS["process"].Params.model_validate({"cmdline": own})
ctx = ProbeContext(client=httpx.Client(), connection=for_host({}), timeout=2.0)
result = run_probe("process probe", "process", params, ctx)
print(result.ok, result.reason)
"""


def test_process_probe_never_finds_ralph_run_itself(tmp_path):
    command = [sys.executable, "-c", SELF_PROBE, str(tmp_path)]

    answer = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)

    assert answer.stdout.split() == ["False", "refused"]


def test_process_params_need_a_field_and_a_valid_regex():
    with pytest.raises(ValidationError, match="needs pidfile, name or cmdline"):
        probes.KINDS["process"].Params.model_validate({})
    with pytest.raises(ValidationError, match="not a regular expression"):
        probes.KINDS["process"].Params.model_validate({"cmdline": "vllm("})
