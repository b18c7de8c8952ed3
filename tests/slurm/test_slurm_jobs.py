"""Loops as real Slurm jobs: submitted by `ralph-run slurm submit`, each running the runbook on
the node with the GPUs Slurm gave it, requeued when its server cannot be recovered or its time
runs out, cancelled with its teardown run, and watched with `ralph-run slurm status`."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_helpers import (
    CANNOT_RECOVER,
    STANDIN_PIDS,
    all_done_once,
    fleet,
    job_state,
    ralph_slurm,
    slurm,
    wait_ended,
)
from support.standin import wait_for

AGENT_STEP = "run the agent"


def test_two_loops_finish_as_two_jobs_on_the_gpus_slurm_gave(tmp_path: Path) -> None:
    jobs_file, loops = fleet(tmp_path, {"a": ["alpha", "beta"], "b": ["gamma", "delta"]}, gpus=2)
    submitted = ralph_slurm("submit", str(jobs_file)).stdout
    assert "a: submitted job" in submitted and "b: submitted job" in submitted
    wait_ended(loops)
    for loop in loops:
        all_done_once(loop)
        assert job_state(loop.job_id()) == "COMPLETED"
        (start,) = loop.events("start")
        (end,) = loop.events("end")
        assert end["exit"] == 0
        # the server was started inside the allocation, on the GPUs Slurm gave the job
        assert (loop.workdir / "server-gpus").read_text().strip() == start["gpus"]
        assert (loop.workdir / "teardown.log").read_text() == "torn down\n"
    # side by side on the node's 4 GPUs: two each, none shared
    assert sorted(loop.events("start")[0]["gpus"] for loop in loops) == ["0,1", "2,3"]


def test_a_job_whose_server_cannot_be_recovered_is_requeued_and_finishes(tmp_path: Path) -> None:
    """The server dies after the second item on the first attempt, and that attempt's node
    cannot start it again: the loop exits 4, the job is requeued, and the next attempt resumes
    from the workdir's state: every item done once, the death record kept."""
    kill_on_first_attempt = (
        '[ "${SLURM_RESTART_COUNT:-0}" != 0 ] || ! grep -q "x] second" CHECKLIST.md || '
        + STANDIN_PIDS
    )
    jobs_file, (loop,) = fleet(
        tmp_path,
        {"dies": ["first", "second", "third", "fourth"]},
        recovery_prefix=CANNOT_RECOVER,
        after_agent=kill_on_first_attempt,
    )
    ralph_slurm("submit", str(jobs_file))
    wait_ended([loop])
    all_done_once(loop)
    events = [a["event"] for a in loop.attempts()]
    assert events == ["start", "requeue-server", "start", "end"], loop.attempts()
    assert [a["exit"] for a in loop.events("requeue-server")] == [4]
    assert [a["attempt"] for a in loop.events("start")] == [0, 1]
    assert len({a["job"] for a in loop.attempts()}) == 1  # one job, requeued
    assert loop.death_records(), "the first attempt's death record was lost"
    assert job_state(loop.job_id()) == "COMPLETED"


def test_a_server_no_node_can_recover_ends_the_job_after_max_requeues(tmp_path: Path) -> None:
    """max_requeues: 1 and a server that never starts again once it died: the first attempt is
    requeued, the second ends the job with exit 4 (no requeue loop)."""
    kill_after_first = '! grep -q "x] only" CHECKLIST.md || ' + STANDIN_PIDS
    never_again = (
        "if [ -e server-started-once ]; then echo 'no node can start it' >&2; exit 1; fi;"
        " touch server-started-once; "
    )
    jobs_file, (loop,) = fleet(
        tmp_path,
        {"doomed": ["only", "never"]},
        recovery_prefix=never_again,
        after_agent=kill_after_first,
        max_requeues=1,
    )
    ralph_slurm("submit", str(jobs_file))
    wait_ended([loop])
    events = [(a["event"], a["exit"]) for a in loop.attempts()]
    assert events == [("start", None), ("requeue-server", 4), ("start", None), ("end", 4)]
    assert job_state(loop.job_id()) == "FAILED"
    assert loop.commits()[1:] == ["done: only"]


def test_the_time_limit_signal_stops_at_the_item_boundary_and_the_requeued_job_finishes(
    tmp_path: Path,
) -> None:
    """USR1 (what `--signal=B:USR1@T` sends before the time limit), sent while the agent works
    on the first item: that item is finished and committed, the loop stops before the next,
    the job is requeued and its next attempt does the rest."""
    jobs_file, (loop,) = fleet(tmp_path, {"slow": ["uno", "dos"]}, agent_sleep="1")
    ralph_slurm("submit", str(jobs_file))
    wait_for(
        lambda: loop.status().get("phase") == AGENT_STEP and loop.status().get("item") == "uno",
        30,
        "the agent working on the first item",
    )
    slurm("scancel", "--batch", "--signal=USR1", loop.job_id())
    wait_ended([loop])
    all_done_once(loop)
    events = [a["event"] for a in loop.attempts()]
    assert events == ["start", "requeue-time-limit", "start", "end"], loop.attempts()
    stopped_at = loop.events("requeue-time-limit")[0]["at"]
    first_attempt = [c for c in loop.commit_times() if c[1] < stopped_at]
    assert [subject for subject, _ in first_attempt] == ["done: uno"]  # finished, not cut
    assert not loop.death_records()  # a stop, not a death
    assert not (loop.workdir / ".ralph" / "pause").exists()  # the next run was not held


def test_scancel_runs_the_loops_teardown(tmp_path: Path) -> None:
    jobs_file, (loop,) = fleet(tmp_path, {"cancelled": ["long", "longer"]}, agent_sleep="30")
    ralph_slurm("submit", str(jobs_file))
    wait_for(lambda: loop.status().get("phase") == AGENT_STEP, 30, "the agent working")
    assert "cancelled (its loop runs its teardown)" in ralph_slurm("stop", str(jobs_file)).stdout
    wait_ended([loop])
    assert (loop.workdir / "teardown.log").read_text() == "torn down\n"
    assert [a["event"] for a in loop.attempts()] == ["start", "cancelled"]
    assert loop.events("cancelled")[0]["exit"] == 143
    assert "- [x]" not in loop.checklist()
    assert job_state(loop.job_id()) == "CANCELLED"


def test_status_shows_every_job_joined_with_its_loop(tmp_path: Path) -> None:
    names = {"north": ["n1"], "south": ["s1", "s2"], "east": ["e1"]}
    jobs_file, loops = fleet(tmp_path, names)
    before = ralph_slurm("status", str(jobs_file), check=False)
    assert before.returncode == 1  # none submitted yet
    assert before.stdout.count("not submitted") == 3
    ralph_slurm("submit", str(jobs_file))
    wait_ended(loops)
    shown = ralph_slurm("status", str(jobs_file)).stdout.splitlines()
    for loop in loops:
        (row,) = [line for line in shown if line.startswith(loop.name + " ")]
        assert loop.job_id() in row and "COMPLETED" in row, row
        assert f"finished, {len(loop.items)}/{len(loop.items)} items, 0 deaths" in row, row
    rows = [
        json.loads(line)
        for line in ralph_slurm("status", str(jobs_file), "--json").stdout.splitlines()
    ]
    assert {row["name"]: row["slurm"] for row in rows} == dict.fromkeys(names, "COMPLETED")
    assert all(row["attempts"] == 1 and row["requeues"] == 0 for row in rows)


def test_pause_and_resume_steer_one_job_of_the_file(tmp_path: Path) -> None:
    """`--job NAME` pauses that loop alone at its item boundary (its job keeps its allocation),
    the other finishes; `resume` lets the paused one finish."""
    jobs_file, (held, free) = fleet(
        tmp_path, {"held": ["h1", "h2"], "free": ["f1", "f2"]}, agent_sleep="0.5"
    )
    ralph_slurm("submit", str(jobs_file))
    wait_for(lambda: held.status().get("phase") == AGENT_STEP, 30, "the held loop's agent")
    paused = ralph_slurm("pause", str(jobs_file), "--job", "held").stdout
    assert "pause asked for" in paused and str(free.workdir) not in paused
    wait_for(lambda: held.status().get("paused"), 30, "the held loop paused")
    wait_ended([free])
    all_done_once(free)
    assert job_state(held.job_id()) == "RUNNING"
    done_while_paused = held.checklist().count("- [x]")
    assert done_while_paused < len(held.items)
    ralph_slurm("resume", str(jobs_file), "--job", "held")
    wait_ended([held])
    all_done_once(held)
    assert [a["event"] for a in held.attempts()] == ["start", "end"]
