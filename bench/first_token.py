"""`python -m bench.first_token [--before REF]`: the first step's bound (issue 36), hang to
death and false deaths, with runbooks/vllm.yaml's health block as shipped, the agent's calls
**not streamed** (bench/agents/whole_answer.py, through the loop's proxy), on the stand-in: the
code before (REF, default the main before issue 36, from a git worktree) against this checkout,
in one run.

- idle hang: EngineCore stops when the agent step starts, the agent's request follows a moment
  later (a 2,000-token prompt);
- hang mid-generation: the engine stops about 20 tokens into a non-streamed 3,000-token answer
  (decode at 50 tokens/s);
- slow prompt, no hang: a 4,800-token prompt read in 6 s steps (a slow box's chunked prefill),
  answered whole; the run's first checks see the engine already slow (the calibration measures
  what the engine is): deaths counted until the item is done or 4 minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.hang_bound import ROOT, Case, one

BEFORE = "9ae3db1"  # main before issue 36
AGENT = [sys.executable, str(ROOT / "bench" / "agents" / "whole_answer.py"), "{{ agent_base_url }}"]
IDLE = Case("idle hang before the agent's request", (), 0.0, 2000)
MID = Case("hang ~20 tokens into a whole answer", (("tokens_per_second", 50),), 0.8)
SLOW = Case(
    "slow prompt (6 s steps), no hang",
    (("prefill_tokens_per_second", 100), ("prefill_chunk", 600)),
    None,
    4800,
)
MAX_TOKENS = {IDLE: 20, MID: 3000, SLOW: 20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the code to compare (a git ref)")
    before = parser.parse_args().before
    health = yaml.safe_load((ROOT / "runbooks" / "vllm.yaml").read_text())["health"]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp, "before")
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(tree), before], cwd=ROOT, check=True
        )
        try:
            codes = {
                f"before ({before})": {**os.environ, "PYTHONPATH": str(tree)},
                "now": {**os.environ, "PYTHONPATH": str(ROOT)},
            }
            print("| case | code | hang to death | deaths | item done |")
            print("|---|---|---|---|---|")
            for case in (IDLE, MID, SLOW):
                agent = [*AGENT, str(MAX_TOKENS[case])]
                for name, env in codes.items():
                    got = one(health, case, agent, env, early=True)
                    found = "-" if got.found_after is None else f"{got.found_after:.1f} s"
                    done = "yes" if got.done else "no"
                    print(f"| {case.name} | {name} | {found} | {got.deaths} | {done} |", flush=True)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
