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
from support.standin import wait_for

from ralph_runner.process import execute, orphans, tree_guard

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
    [
        "", "{", "7", '{"pid": 1}', '[7, null, "x", {"pid": "1"}, {"pid": 1}, {"pid": -1}]',
        # each names the sleeper, with its true start where it has one: only a whole, valid
        # record kills (test_a_recorded_process_still_the_one_recorded_is_killed)
        '[{"pid": PID, "started": TICKS}',  # torn: the record's closing bracket never written
        '[{"pid": PID, "started": TICKS}, {"pid": ',  # torn in the next record
        '{"pid": PID, "started": TICKS}',  # foreign: a record, not a list of them
        '[{"pid": PID}]',  # no start
        '[{"pid": PID, "started": null}]',
        '[{"pid": PID, "started": "TICKS"}]',  # the start as text
        '[{"pid": "PID", "started": TICKS}]',  # the pid as text
        "[[PID, TICKS]]",
    ],
)  # fmt: skip
def test_a_torn_or_foreign_record_is_ignored(tmp_path, sleeper, text):
    path = tmp_path / orphans.FILE
    path.write_text(text.replace("PID", str(sleeper.pid)).replace("TICKS", str(ticks(sleeper.pid))))
    orphans.clear(path)  # no exception, nothing killed: pid 1 never, a pid without start never
    assert sleeper.poll() is None
    assert psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE


def test_the_record_lists_each_running_command_with_its_start_in_ticks(tmp_path):
    """While a command runs, the file holds its pid and kernel start; afterwards it is gone.

    The command reads the file itself, once its pid shows there (a command that has exited
    already is no longer listed), and prints its own start from /proc."""
    record = tmp_path / orphans.FILE
    look = (
        f'until grep -q "\\"pid\\": $$," {record}; do sleep 0.01; done; '
        f'echo $$; cut -d" " -f22 /proc/$$/stat; cat {record}'
    )
    with orphans.recorded(tmp_path):
        result = execute.shell(look, timeout=10)
    assert result.ok, result.output
    pid, started, text = result.output.split("\n", 2)
    assert json.loads(text) == [{"pid": int(pid), "started": int(started)}]
    assert not record.exists()


def test_start_time_is_the_kernels_and_none_for_a_dead_pid(sleeper):
    assert tree_guard.start_time(sleeper.pid) == ticks(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    wait_for(lambda: tree_guard.start_time(sleeper.pid) is None, 5, "the pid to be gone")
