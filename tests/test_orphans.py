"""`.ralph/running.json`: what a run killed with -9 leaves, and what the next run does with it.

A record names a process by pid and by its start in clock ticks since boot (/proc/PID/stat):
that pair never changes while the process lives, whatever the wall clock does, and a pid the
kernel gave to another process since has another start.
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest
from standin_helpers import wait_for

from ralph_runner import execute, orphans, watchdog

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


@pytest.fixture
def sleeper():
    process = subprocess.Popen(SLEEPER, start_new_session=True)
    yield process
    process.kill()
    process.wait()


def ticks(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])


def test_a_recorded_process_still_the_one_recorded_is_killed(tmp_path, sleeper):
    path = tmp_path / orphans.FILE
    path.write_text(json.dumps([{"pid": sleeper.pid, "started": ticks(sleeper.pid)}]))
    orphans.clear(path)
    assert sleeper.wait(timeout=10) == -15  # TERM first: it had no reason to ignore it


def test_a_pid_that_started_at_another_time_is_spared(tmp_path, sleeper):
    path = tmp_path / orphans.FILE
    path.write_text(json.dumps([{"pid": sleeper.pid, "started": ticks(sleeper.pid) - 1}]))
    orphans.clear(path)
    assert psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE
    assert sleeper.poll() is None


@pytest.mark.parametrize(
    "text",
    ["", "{", "7", '{"pid": 1}', '[7, null, "x", {"pid": "1"}, {"pid": 1}, {"pid": -1}]'],
)
def test_a_torn_or_foreign_record_is_ignored(tmp_path, sleeper, text):
    path = tmp_path / orphans.FILE
    path.write_text(text)
    orphans.clear(path)  # no exception, nothing killed: pid 1 never, a pid without start never
    assert sleeper.poll() is None


def test_the_record_lists_each_running_command_with_its_start_in_ticks(tmp_path):
    """While a command runs, the file holds its pid and kernel start; afterwards it is gone."""
    seen: list[list[dict]] = []

    def read_record(line: str) -> None:
        seen.append(json.loads((tmp_path / orphans.FILE).read_text()))

    with orphans.recorded(tmp_path):
        result = execute.shell("echo $$", on_output=read_record)
    (pid,) = [int(line) for line in result.output.split()]
    assert seen == [[{"pid": pid, "started": seen[0][0]["started"]}]]
    assert isinstance(seen[0][0]["started"], int)
    assert not (tmp_path / orphans.FILE).exists()


def test_start_time_is_the_kernels_and_none_for_a_dead_pid(sleeper):
    assert watchdog.start_time(sleeper.pid) == ticks(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    wait_for(lambda: watchdog.start_time(sleeper.pid) is None, 5, "the pid to be gone")
