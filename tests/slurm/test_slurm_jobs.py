"""Loops as real Slurm jobs: submitted by `ralph-run slurm submit`, each running the runbook on
the node with the GPUs Slurm gave it, requeued when its server cannot be recovered or its time
runs out, cancelled with its teardown run, and watched with `ralph-run slurm status`."""

from __future__ import annotations

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
