"""`python -m bench.poison_item`: items done per hour of a night with one poison item among 50,
before and after deaths an item causes (loop/blame.py, docs/deaths.md), in the same run.

The server: the stand-in born broken (start_server.sh's FAULTS, so each restart by the recovery
is as broken): a prompt over 6,000 characters kills its engine, as the seed's KV-cache
assertion did. The loop: runbooks/demo.yaml as shipped (its probes, its recovery, its
crash-loop breaker: 5 deaths in 600 s), `max_iterations` lifted, on a checklist of 50 items
whose middle one has an 8,000-character text. "Before": `checklist.set_aside_after: 0`, the old rule
(a death is never the item's: the item is retried after each one); "after": the default, 2.
Two rates: items per hour of the run's own time, and items per night-hour, the night being the
longer run's time (a run the breaker ended does nothing for the rest of the night).

`--items N` changes the checklist's length (the poison stays in its middle).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench import stand
from bench.stand import free_port
from bench.workers import ROOT, STANDIN_START

# characters: a prompt over it kills the engine. Above the progress probe's calibration (its one
# pace measure, ~4,300 characters, plugins/first_token.py): a server that cannot take that dies
# at the first check, whatever the items.
LIMIT = 6000
POISON = "poison: " + "p" * 8000
FAULTS = json.dumps({"die_on_prompt_chars": LIMIT})


@dataclass(frozen=True)
class Night:
    rule: str
    code: int
    done: int
    items: int
    set_aside: int
    deaths: int
    seconds: float

    @property
    def per_hour(self) -> float:
        return self.done / self.seconds * 3600 if self.seconds > 0 else 0.0


def workspace(path: Path, items: int) -> None:
    """bench.stand's workspace of `items` items, the middle one the poison."""
    stand.workspace(path, items)
    checklist = path / "CHECKLIST.md"
    lines = checklist.read_text().splitlines()
    lines[items // 2] = f"- [ ] {POISON}"
    checklist.write_text("\n".join(lines) + "\n")
    subprocess.run(["git", "commit", "-qam", "the poison item"], cwd=path, check=True)


def night(scratch: Path, rule: str, after: int, items: int) -> Night:
    """One run of the loop to its end; the server started, broken, and stopped."""
    work, state, port = scratch / rule / "work", scratch / rule / "standin", free_port()
    workspace(work, items)
    book = yaml.safe_load((ROOT / "runbooks" / "demo.yaml").read_text())
    book["loop"]["max_iterations"] = 0
    book["checklist"]["set_aside_after"] = after
    runbook = scratch / rule / "runbook.yaml"
    runbook.write_text(yaml.safe_dump(book, sort_keys=False))
    env = {**bench_env(), "FAULTS": FAULTS}  # the recovery's restarts inherit it
    subprocess.run(
        [str(STANDIN_START), str(port), str(state)], env=env, check=True, capture_output=True
    )
    facts = {"port": port, "standin_dir": str(state), "standin_start": str(STANDIN_START),
             "python": sys.executable}  # fmt: skip
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ralph_runner", str(runbook), "--json", "-e", json.dumps(facts)],
            cwd=work, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
    finally:
        pid_file = state / "server.pid"  # none when the run ended with the server dead
        if pid_file.exists():
            pid = pid_file.read_text().strip()
            subprocess.run(["kill", "-TERM", "--", f"-{pid}"], check=False, capture_output=True)
    seconds = time.monotonic() - started
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    marks = [line[3] for line in (work / "CHECKLIST.md").read_text().splitlines()]
    return Night(
        rule=rule,
        code=done.returncode,
        done=marks.count("x"),
        items=items,
        set_aside=sum(1 for e in found if e["event"] == "item-set-aside"),
        deaths=sum(1 for e in found if e["event"] == "death"),
        seconds=seconds,
    )


def bench_env() -> dict[str, str]:
    """ralph-run's environment: this checkout's code, this Python (its recovery inherits it)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHON": sys.executable}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.poison_item", description=__doc__)
    parser.add_argument("--items", type=int, default=50)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="poison-") as scratch:
        nights = [
            night(Path(scratch), "before", 0, args.items),
            night(Path(scratch), "after", 2, args.items),
        ]
    print(f"# one poison item in {args.items}: {platform.node()}, {time.strftime('%Y-%m-%d')}")
    print()
    night_seconds = max(n.seconds for n in nights)
    print("| rule | exit | items done | set aside | deaths | seconds | items/run-hour "
          "| items/night-hour |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n in nights:
        print(
            f"| {n.rule} | {n.code} | {n.done} of {n.items} | {n.set_aside} | {n.deaths} "
            f"| {n.seconds:.1f} | {n.per_hour:.0f} | {n.done / night_seconds * 3600:.0f} |"
        )
    before, after = nights
    print()
    print(f"per night-hour: {after.done / max(before.done, 1):.2f}x the items")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
