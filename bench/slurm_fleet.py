"""`python -m bench.slurm_fleet`: 8 loops as Slurm jobs on one node with 4 (fake) GPUs, 2 of them
with servers that die and cannot be brought back on their first attempt's node.

The one-node Slurm of ci/install-slurm.sh (start it first), the slurm tier's loops
(tests/slurm/slurm_helpers.py: the stand-in server started inside each job by the runbook, the
stand-in agent), one GPU per job: four run at a time, the other four wait for a GPU. Measured:
every item of every loop done exactly once (one commit each), the requeues, and Slurm's
overhead per job start from the jobs' own records (.ralph/slurm/): submit -> the batch script's
first line for the jobs that found a GPU free, a GPU freed (a job's end or requeue) -> the next
job's first line, and requeue -> the requeued job's first line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "slurm"))

from slurm_helpers import (  # noqa: E402  (the tier's helpers: the same jobs, measured)
    STANDIN_PIDS,
    Loop,
    all_done_once,
    fleet,
    ralph_slurm,
    tier_missing,
    wait_ended,
)

GPUS = 4  # the node's (ci/install-slurm.sh)
# the dying loops: after their third item on the first attempt their server is killed, and that
# attempt's node cannot start it again: exit 4, requeued
DIES = '[ {{ dies }} = yes ] && [ "${SLURM_RESTART_COUNT:-0}" = 0 ]'
KILL_AFTER_THIRD = f'! {{ {DIES} && grep -q "x] item 3" CHECKLIST.md; }} || {STANDIN_PIDS}'
CANNOT_RECOVER = (
    f"if {DIES} && [ -e server-started-once ]; then echo 'this node cannot start it' >&2;"
    " exit 1; fi; touch server-started-once; "
)


def spread(values: list[float]) -> str:
    if not values:
        return "none"
    median = statistics.median(values)
    return f"{min(values):.2f}-{max(values):.2f} s (median {median:.2f}, n={len(values)})"


def starts_and_frees(loops: list[Loop]) -> tuple[list[float], list[float]]:
    """Every attempt's first line, and every moment a GPU was freed (an end, a requeue)."""
    starts, frees = [], []
    for loop in loops:
        for line in loop.attempts():
            (starts if line["event"] == "start" else frees).append(line["at"])
    return sorted(starts), sorted(frees)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=8)
    parser.add_argument("--dying", type=int, default=2)
    parser.add_argument("--items", type=int, default=6)
    args = parser.parse_args(argv)
    missing = tier_missing()
    if missing:
        print(f"slurm_fleet: skipped: {missing}")
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as scratch:
        names = [f"loop{n + 1}" for n in range(args.loops)]
        dying = set(names[: args.dying])
        jobs_file, loops = fleet(
            Path(scratch),
            {name: [f"item {i + 1}" for i in range(args.items)] for name in names},
            gpus=1,
            recovery_prefix=CANNOT_RECOVER,
            after_agent=KILL_AFTER_THIRD,
            loop_vars={name: {"dies": "yes" if name in dying else "no"} for name in names},
        )
        began = time.time()
        ralph_slurm("submit", str(jobs_file))
        wait_ended(loops, timeout=600)
        wall = time.time() - began
        for loop in loops:
            all_done_once(loop)
        items = sum(len(loop.items) for loop in loops)
        requeues = {loop.name: len(loop.events("requeue-server")) for loop in loops}
        submitted = {loop.name: _submitted(loop) for loop in loops}
        firsts = sorted((loop.events("start")[0]["at"], loop.name) for loop in loops)
        at_once = [at - submitted[name] for at, name in firsts[:GPUS]]
        starts, frees = starts_and_frees(loops)
        handoffs = []
        for start in starts[GPUS:]:  # each later start took a GPU a job had freed before it
            handoffs.append(start - max(free for free in frees if free < start))
        after_requeue = []
        for loop in loops:
            lines = loop.attempts()
            for before, after in itertools.pairwise(lines):
                if before["event"].startswith("requeue") and after["event"] == "start":
                    after_requeue.append(after["at"] - before["at"])
        print(f"loops: {args.loops} ({args.dying} with servers that die), {GPUS} GPUs, 1 per job")
        print(f"items done: {items} of {items}, each once (one commit each)")
        print(f"requeues: {sum(requeues.values())} ({requeues})")
        print(f"wall: {wall:.1f} s from submit to the last job's end")
        print(f"submit -> first line (a GPU free): {spread(at_once)}")
        print(f"GPU freed -> next job's first line: {spread(handoffs)}")
        print(f"requeue -> the requeued job's first line: {spread(after_requeue)}")
    return 0


def _submitted(loop: Loop) -> float:
    record = loop.workdir / ".ralph" / "slurm" / "submission.json"
    return float(json.loads(record.read_text())["submitted"])


if __name__ == "__main__":
    sys.exit(main())
