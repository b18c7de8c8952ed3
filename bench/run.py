"""`python -m bench [--only CASE ...] [--json FILE] [--keep]`: run the cases, print the table."""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import psutil

from bench import cases, deathdata, real
from bench.stand import ROOT, Server, leftovers
from bench.table import Row, render

CASES: dict[str, Callable[[cases.Bench], list[Row]]] = {
    "healthy": cases.healthy_round,
    "loop": cases.loop_overhead,
    "detect": cases.detection,
    "diagnostics": cases.diagnostics_wall,
    "resume": cases.resume,
    "check": cases.check,
    "rss": cases.rss,
    "recorder": deathdata.recorder_cost,
    "deaths": deathdata.deaths_scale,
    "report": deathdata.report_scale,
    "real": real.real_engine,  # the real vLLM (ci/install-vllm.sh), else skipped
}
NEEDED = ("curl", "git", "bash", "setsid", "timeout")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--only", nargs="+", choices=CASES, help="run these cases only")
    parser.add_argument("--json", type=Path, help="also write every sample to this file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing:
        print(f"bench: missing {', '.join(missing)} (apt-get install -y curl)", file=sys.stderr)
        return 2
    if not Path(cases.ANSIBLE_PLAYBOOK).is_file():
        print(f"bench: no {cases.ANSIBLE_PLAYBOOK}: install ansible-core", file=sys.stderr)
        return 2

    # ralph-run as pip installs it: bytecode compiled. A checkout run with
    # PYTHONDONTWRITEBYTECODE (as on CI machines) would compile every module at every start.
    compileall.compile_dir(ROOT / "ralph_runner", quiet=1)
    scratch = Path(tempfile.mkdtemp(prefix="ralph-bench-"))
    machine = describe_machine()
    server = Server(scratch / "server")
    rows: list[Row] = []
    started = time.monotonic()
    try:
        server.start()
        bench = cases.Bench(scratch, server)
        for name in args.only or CASES:
            began = time.monotonic()
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            rows += CASES[name](bench)
            print(f"bench: {name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    finally:
        server.kill()
        if args.keep:
            print(f"bench: scratch kept in {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.monotonic() - started
    stray = leftovers()
    summary = f"{machine} Whole run: {elapsed:.0f} s."
    if stray:
        summary += f" Processes left running: {stray}."
    print(render("ralph-run benchmarks", summary, rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    return 0


def describe_machine() -> str:
    """Date, machine size and tool versions: what a reader needs to compare numbers."""
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpus = len(os.sched_getaffinity(0))
    memory = psutil.virtual_memory().total / 2**30
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    versions = [
        f"Python {platform.python_version()}",
        _first_line(["bash", "--version"]).split(" (")[0].replace("GNU bash, version", "bash"),
        " ".join(_first_line(["curl", "--version"]).split()[:2]),
        f"ansible-core {metadata.version('ansible-core')}",
    ]
    commit = _first_line(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = _first_line(["git", "-C", str(ROOT), "status", "--porcelain", "--", "ralph_runner"])
    return (
        f"{now} · {cpus} CPUs (nproc), {memory:.1f} GiB memory, {_cpu_model()}, "
        f"Linux {platform.release()} · {', '.join(versions)} · ralph-run at {commit}"
        f"{' + uncommitted changes' if dirty else ''} · load average at start {load}."
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _first_line(argv: list[str]) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except OSError:
        return "?"
    return (result.stdout.splitlines() or ["?"])[0]
