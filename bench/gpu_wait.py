"""`python -m bench.gpu_wait`: freed-to-recovered, waiting for the GPU against a fixed delay.

The seed's story (docs/writing-runbooks.md, "A GPU shared through a scheduler"): the server
dies, a background job takes 80 of the 96 GB meanwhile, and lets go a while later. The seed's
recovery tried, waited a fixed 30 s, tried again. Each trial here runs a real loop (the e2e
runbook on the vLLM stand-in, tests/support/gpu_sched_standin.py as the scheduler), stops the
server with the other job holding its memory, and has that job release it `HOLD` s later; it
measures from the release (the scheduler's own log) to the restart's start and to `recovered`:

- wait: the recovery's `wait: {command: acquire ..., every: 0.5}` (the shipped example);
- delay D: `acquire` as a plain step (refused while the job holds), `attempts: 2, delay: D`, as
  the seed (D = 30) and the hidden scenario S3 (D = 4) did.

Prints a markdown table of medians; `--trials N` (default 5), `--delays 4 30`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.e2e import Scenario  # noqa: E402  (the tests' helpers: the same loop, measured)

SCHEDULER = ROOT / "tests" / "support" / "gpu_sched_standin.py"
HOLD = 2.0  # s the background job keeps the memory after the server died
MARK = 'echo "$(date +%s.%N) start the server -> 0" >> {{ sched_dir }}/calls.log'
ACQUIRE = "{{ gpu_sched }} acquire vllm-chat 88"


def recovery(mode: str, delay: float) -> dict[str, Any]:
    """The recovery block of one mode, before the stand-in's own start step."""
    if mode == "wait":
        acquire = {"name": "wait for the GPU", "wait": {"command": ACQUIRE, "max": 60}}
        return {"steps": [acquire, {"name": "mark", "shell": MARK}], "attempts": 1, "delay": 0}
    acquire = {"name": "acquire the GPU", "shell": ACQUIRE}
    return {"steps": [acquire, {"name": "mark", "shell": MARK}], "attempts": 2, "delay": delay}


def trial(mode: str, delay: float, root: Path) -> tuple[float, float]:
    """(release to restart's start, release to recovered), in seconds."""
    scenario = Scenario(root)
    try:
        scenario.prepare(["one", "two"], agent_sleep="3 if iteration == 1 else 0.1")
        sched_dir = root / "sched"
        sched_dir.mkdir()
        script = root / "gpu-sched"
        script.write_text(
            f'#!/bin/sh\nGPU_SCHED_DIR={sched_dir} exec {sys.executable} {SCHEDULER} "$@"\n'
        )
        script.chmod(0o755)
        book = yaml.safe_load(scenario.runbook_path.read_text())
        book["vars"].update(gpu_sched=str(script), sched_dir=str(sched_dir))
        start = book["recovery"]["steps"]
        book["recovery"].update(recovery(mode, delay))
        book["recovery"]["steps"] += start
        book["recovery"]["healthy_within"] = 20
        scenario.runbook_path.write_text(yaml.safe_dump(book, sort_keys=False))
        run = scenario.start()
        run.wait_agent(1)
        subprocess.run([str(script), "acquire", "vlm-batch", "80"], check=True, capture_output=True)
        scenario.standin.stop()
        run.wait_event("death", timeout=30)
        time.sleep(HOLD)
        subprocess.run([str(script), "release", "vlm-batch"], check=True, capture_output=True)
        code = run.wait(120)
        if code != 0:
            raise RuntimeError(f"{mode}: exit {code}: {run.events} {run.stderr}")
        calls = [line.split(" ", 1) for line in (sched_dir / "calls.log").read_text().splitlines()]
        freed = next(float(t) for t, said in calls if said.startswith("release vlm-batch"))
        started = next(
            float(t) for t, said in calls if float(t) > freed and said.startswith("start the")
        )
        (recovered,) = run.of("recovery")
        return started - freed, _epoch(recovered["time"]) - freed
    finally:
        scenario.close()


def _epoch(stamp: Any) -> float:
    if isinstance(stamp, int | float):
        return float(stamp)
    from datetime import datetime

    return datetime.fromisoformat(str(stamp)).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--delays", type=float, nargs="*", default=[4.0, 30.0])
    args = parser.parse_args()
    modes = [("wait", 0.0)] + [("delay", d) for d in args.delays]
    rows = []
    for mode, delay in modes:
        samples = []
        for _ in range(args.trials):
            with tempfile.TemporaryDirectory(prefix="ralph-gpu-wait-") as tmp:
                samples.append(trial(mode, delay, Path(tmp)))
        label = "wait (every 0.5 s)" if mode == "wait" else f"fixed delay {delay:g} s"
        starts, recovered = [s for s, _ in samples], [r for _, r in samples]
        rows.append((label, starts, recovered))
        print(json.dumps({"mode": label, "samples": samples}), file=sys.stderr)
    print(f"other job releases {HOLD:g} s after the death; {args.trials} trials each\n")
    print("| recovery | freed -> restart starts (median, max) | freed -> recovered (median) |")
    print("|---|---|---|")
    for label, starts, recovered in rows:
        print(
            f"| {label} | {statistics.median(starts):.2f} s, {max(starts):.2f} s "
            f"| {statistics.median(recovered):.2f} s |"
        )


if __name__ == "__main__":
    main()
