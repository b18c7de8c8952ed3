"""pause / resume / status / top at their corners (issue 31, item 6), with the real commands: a
pause left on a loop that ended shows in `status` and `top`; `pause` on a paused loop says it is
already paused; a workdir that does not exist is exit 2 for `resume` and `top` as for `pause`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.e2e import Scenario
from support.standin import ralph

from ralph_runner.loop import pause

pytestmark = pytest.mark.timeout(120)


def test_a_pause_left_on_a_stopped_loop_shows_and_is_not_asked_for_twice(
    scenario: Scenario,
) -> None:
    scenario.prepare(["one"])
    run = scenario.start()
    assert run.wait(60) == 0, run.stderr
    workdir = scenario.workspace

    shown = ralph("status", str(workdir))
    assert shown.returncode == 0 and "pause:" not in shown.stdout, shown.stdout

    asked = ralph("pause", str(workdir))
    assert asked.returncode == 0, asked.stderr
    assert "pause asked for" in asked.stdout
    request = pause.control_path(workdir).read_text()

    again = ralph("pause", str(workdir))
    assert again.returncode == 0, again.stderr
    assert f"{workdir}: already paused: the loop is not running" in again.stdout, again.stdout
    assert "pause asked for" not in again.stdout
    assert pause.control_path(workdir).read_text() == request  # kept: its time, its author

    shown = ralph("status", str(workdir))
    assert shown.returncode == 0, shown.stderr
    assert "pause:      paused (the loop is not running)" in shown.stdout, shown.stdout
    assert "`ralph-run resume` clears it" in shown.stdout
    as_json = json.loads(ralph("status", str(workdir), "--json").stdout)
    assert as_json["pause_left"] is True and as_json["running"] is False

    top = ralph("top", "--once", str(workdir))
    assert top.returncode == 0, top.stderr
    (row,) = [line for line in top.stdout.splitlines() if line.startswith(f">{workdir.name} ")]
    assert "finished, paused" in row, top.stdout

    inventory = scenario.root / "inventory.yaml"  # `status -i`: over the host's connection
    hosts = {"here": {"ansible_connection": "local", "ralph_workdir": str(workdir)}}
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    fleet = ralph("status", "-i", str(inventory))
    assert fleet.returncode == 0, fleet.stdout + fleet.stderr  # a finished run is no read error
    (row,) = [line for line in fleet.stdout.splitlines() if line.startswith("here ")]
    assert row.split()[1:3] == ["finished,", "paused"], fleet.stdout

    resumed = ralph("resume", str(workdir))
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stdout
    assert "pause:" not in ralph("status", str(workdir)).stdout
    top = ralph("top", "--once", str(workdir))
    assert "paused" not in top.stdout, top.stdout


def test_a_missing_workdir_is_exit_2_for_pause_resume_and_top(tmp_path: Path) -> None:
    missing = str(tmp_path / "nonexistent")
    for args in (("pause", missing), ("resume", missing), ("top", "--once", missing)):
        done = ralph(*args)
        assert done.returncode == 2, (args, done.returncode, done.stdout, done.stderr)
        assert "no such workdir" in done.stderr and missing in done.stderr, (args, done.stderr)
        assert not Path(missing).exists()


def test_top_p_on_a_paused_loop_says_so_and_keeps_the_request(tmp_path: Path) -> None:
    """`p` in top, as `ralph-run pause`: a request already there is kept, and said."""
    from concurrent.futures import ThreadPoolExecutor

    from ralph_runner.commands import top

    workdir = tmp_path / "work"
    workdir.mkdir()
    with ThreadPoolExecutor(1) as pool:
        screen = top.View([top.Loop("localhost", str(workdir), None, "work")], pool, 5.0)
        assert screen._control(screen.loops[0], "pause").startswith("pause asked for")
        request = pause.control_path(workdir).read_text()
        assert screen._control(screen.loops[0], "pause").startswith("already paused")
        assert pause.control_path(workdir).read_text() == request
        assert screen._control(screen.loops[0], "resume") == "resumed"
