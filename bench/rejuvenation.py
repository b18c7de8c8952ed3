"""`python -m bench.rejuvenation`: items per hour over a night with a server that rots, without
and with `health.rejuvenate` (issue 40), in the same run; and a soak of a healthy server with
it on, where any rejuvenation is a false positive.

The server: the stand-in rotting from its start (start_server.sh's DECODE_HALFLIFE and
DECODE_FLOOR, so each restart rots again): decode tokens/s per sequence halves every
`--halflife` s down to `--floor`, as vLLM's reported slowdowns, compressed from hours into
seconds. The loop: runbooks/demo.yaml as shipped, `max_iterations` lifted, the agent asking 80
tokens an item; "with": `health.rejuvenate` on decode (30% below baseline for 5 s), its restart
a stop that waits for the old server, then the start script. Each night lasts `--night` s of
wall time, then the run is stopped; items per hour = items ticked / night seconds x 3600.

The soak (`--soak N`): N items on the same stand-in without rot, every sign declared (decode,
time to first token, preemptions, memory) at the night's scale; it counts rejuvenations.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench import stand
from bench.poison_item import bench_env
from bench.stand import free_port
from bench.workers import ROOT, STANDIN_START

TOKENS_PER_SECOND = 100  # a fresh server's decode, per sequence
TOKENS = 80  # asked per item: 0.8 s of decode fresh
STOP = (  # the rotted server goes first, and is gone before the start script looks
    'pid=$(cat {{ standin_dir }}/server.pid); kill -TERM -- "-$pid"; '
    "while kill -0 $pid 2>/dev/null; do sleep 0.05; done"
)
REJUVENATE: dict[str, Any] = {
    "decode_drop": 0.3, "sustained_for": 5, "every": 1, "warmup": 2, "baseline": 5,
    "window": 5, "min_tokens": 60, "min_age": 0, "at_most_every": 0,
}  # fmt: skip
SOAK_SIGNS: dict[str, Any] = {
    "first_token_rise": 1.0, "preemptions_per_minute": 30, "memory_limit_mb": 2000,
    "memory_horizon": 3600,
}  # fmt: skip


@dataclass(frozen=True)
class Night:
    name: str
    done: int
    deaths: int
    rejuvenations: int
    seconds: float

    @property
    def per_hour(self) -> float:
        return self.done / self.seconds * 3600 if self.seconds > 0 else 0.0


def runbook(rejuvenate: dict[str, Any] | None, tokens: int) -> dict[str, Any]:
    """demo.yaml with the loop unbounded, the agent asking `tokens`, and `rejuvenate`."""
    book: dict[str, Any] = yaml.safe_load((ROOT / "runbooks" / "demo.yaml").read_text())
    book["loop"]["max_iterations"] = 0
    agent = next(s for s in book["loop"]["steps"] if s.get("name") == "run the agent")
    agent["shell"] = agent["shell"].replace("--sleep 0.3", f"--sleep 0 --max-tokens {tokens}")
    if rejuvenate is not None:
        start = next(s for s in book["recovery"]["steps"] if s["name"] == "start the stand-in")
        book["health"]["rejuvenate"] = {
            **rejuvenate,
            "steps": [{"name": "stop the stand-in", "shell": STOP, "timeout": 10}, start],
        }
    return book


def night(
    scratch: Path, name: str, book: dict[str, Any], rot: dict[str, str], seconds: float,
    items: int,
) -> Night:  # fmt: skip
    """One run for `seconds` of wall time (or to its last item); the server started, stopped."""
    work, state, port = scratch / name / "work", scratch / name / "standin", free_port()
    stand.workspace(work, items)
    path = scratch / name / "runbook.yaml"
    path.write_text(yaml.safe_dump(book, sort_keys=False))
    env = {**bench_env(), "TOKENS_PER_SECOND": str(TOKENS_PER_SECOND), **rot}
    subprocess.run(
        [str(STANDIN_START), str(port), str(state)], env=env, check=True, capture_output=True
    )
    facts = {"port": port, "standin_dir": str(state), "standin_start": str(STANDIN_START),
             "python": sys.executable}  # fmt: skip
    started = time.monotonic()
    run = subprocess.Popen(
        [sys.executable, "-m", "ralph_runner", str(path), "--json", "-e", json.dumps(facts)],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        out, _ = run.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
    elapsed = min(time.monotonic() - started, seconds)
    pid_file = state / "server.pid"
    if pid_file.exists():
        pid = pid_file.read_text().strip()
        subprocess.run(["kill", "-TERM", "--", f"-{pid}"], check=False, capture_output=True)
    found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return Night(
        name=name,
        done=stand.ticked(work),
        deaths=sum(1 for e in found if e["event"] == "death"),
        rejuvenations=sum(1 for e in found if e["event"] == "rejuvenated"),
        seconds=elapsed,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rejuvenation", description=__doc__)
    parser.add_argument("--night", type=float, default=120.0, help="seconds of each night")
    parser.add_argument("--halflife", type=float, default=20.0, help="s: decode halves")
    parser.add_argument("--floor", type=float, default=8.0, help="tokens/s it falls to")
    parser.add_argument("--soak", type=int, default=0, help="items of the healthy soak (0: none)")
    args = parser.parse_args(argv)
    rot = {"DECODE_HALFLIFE": str(args.halflife), "DECODE_FLOOR": str(args.floor)}
    print(f"# rejuvenation: {platform.node()}, {time.strftime('%Y-%m-%d')}")
    print()
    with tempfile.TemporaryDirectory(prefix="rejuvenation-") as scratch:
        if args.night > 0:
            nights = [
                night(
                    Path(scratch),
                    "without",
                    runbook(None, TOKENS),
                    rot,
                    args.night,
                    int(args.night * 3),
                ),
                night(
                    Path(scratch),
                    "with",
                    runbook(REJUVENATE, TOKENS),
                    rot,
                    args.night,
                    int(args.night * 3),
                ),
            ]
            print(f"a night of {args.night:g} s; decode {TOKENS_PER_SECOND} tokens/s at start, "
                  f"halving every {args.halflife:g} s down to {args.floor:g}; {TOKENS} tokens "
                  "an item")  # fmt: skip
            print()
            print("| health.rejuvenate | items done | items/hour | rejuvenations | deaths |")
            print("|---|---|---|---|---|")
            for n in nights:
                print(f"| {n.name} | {n.done} | {n.per_hour:.0f} | {n.rejuvenations} "
                      f"| {n.deaths} |")  # fmt: skip
            without, with_ = nights
            print()
            print(f"items/hour: {with_.per_hour / max(without.per_hour, 1e-9):.2f}x with it")
        if args.soak:
            book = runbook({**REJUVENATE, **SOAK_SIGNS}, 16)
            soak = night(Path(scratch), "soak", book, {}, 24 * 3600.0, args.soak)
            print()
            print(f"soak: {soak.done} of {args.soak} items on a healthy stand-in in "
                  f"{soak.seconds:.0f} s, every sign on: {soak.rejuvenations} rejuvenations "
                  f"(false positives), {soak.deaths} deaths")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
