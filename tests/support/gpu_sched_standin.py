#!/usr/bin/env python3
"""A stand-in for the seed's GPU scheduler (`gpu-sched`): a lock per job with its memory.

    gpu_sched_standin.py status            the holders, and the memory used of the total
    gpu_sched_standin.py acquire JOB GB    exit 0: granted (again, if JOB holds it already);
                                           exit 1: refused, the others hold too much
    gpu_sched_standin.py release JOB       exit 0, held or not (the seed's is as forgiving)

The state is one JSON file in $GPU_SCHED_DIR (default ./.gpu-sched), changed under an
exclusive flock, so concurrent calls (a test's "other job" and the loop's steps) queue. Every
call is appended to $GPU_SCHED_DIR/calls.log with its epoch, what it asked and what it answered:
the tests read who acquired when, and the order of acquire, start and release. The total is
$GPU_SCHED_TOTAL_GB (default 96, the seed's GPU). Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

USAGE = "usage: gpu_sched_standin.py status | acquire JOB GB | release JOB"


def main(argv: list[str]) -> int:
    state_dir = Path(os.environ.get("GPU_SCHED_DIR", ".gpu-sched"))
    state_dir.mkdir(parents=True, exist_ok=True)
    total = float(os.environ.get("GPU_SCHED_TOTAL_GB", "96"))
    with open(state_dir / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        locks_path = state_dir / "locks.json"
        locks: dict[str, float] = json.loads(locks_path.read_text()) if locks_path.exists() else {}
        code, said = answer(argv, locks, total)
        locks_path.write_text(json.dumps(locks))
        with open(state_dir / "calls.log", "a") as log:
            log.write(f"{time.time():.3f} {' '.join(argv)} -> {code}\n")
    print(said)
    return code


def answer(argv: list[str], locks: dict[str, float], total: float) -> tuple[int, str]:
    """The exit code and what is said; `locks` changed in place."""
    match argv:
        case ["status"]:
            used = sum(locks.values())
            holders = [f"  {job}: {gb:g} GB" for job, gb in sorted(locks.items())]
            return 0, "\n".join([f"GPU: {used:g} of {total:g} GB used", *holders])
        case ["acquire", job, gb]:
            wanted = float(gb)
            others = sum(held for holder, held in locks.items() if holder != job)
            if others + wanted > total:
                holders = ", ".join(f"{j} {g:g} GB" for j, g in locks.items() if j != job)
                return 1, f"refused: {job} wants {wanted:g} GB, {holders} of {total:g} held"
            again = job in locks
            locks[job] = wanted
            return 0, f"{job}: {wanted:g} GB" + (" (held already)" if again else "")
        case ["release", job]:
            held = locks.pop(job, None)
            return 0, f"{job}: released" if held is not None else f"{job}: not held"
    return 2, USAGE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
