"""`processes: {top, match}`: who holds the memory right now, and whether the server still runs.

A psutil snapshot of the `top` largest processes by resident memory, plus every process whose
command line matches `match` (e.g. "vllm|standin.server"). CPU% is sampled over SAMPLE seconds.
It sees this machine only: on a remote (ssh) host the task fails and says so.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import TypedDict

import psutil
from pydantic import BaseModel, ConfigDict, NonNegativeInt

from ralph_runner.actions import TaskContext, TaskResult
from ralph_runner.output.text import columns
from ralph_runner.plugins.fields import Regex

KEY = "processes"
MIB = 1024 * 1024
SAMPLE = 0.2  # seconds over which CPU% is measured
COMMAND_WIDTH = 120


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top: NonNegativeInt = 10  # how many of the largest processes (by resident memory) to list
    match: Regex | None = None  # searched in the joined command line


def describe(params: Params, ctx: TaskContext) -> str:
    params = ctx.render_params(params)
    matching = f", and those matching {params.match!r}" if params.match else ""
    return f"list the {params.top} largest processes{matching}"


class ProcessRow(TypedDict):
    """One process, as listed and registered (`top`, `matches`)."""

    pid: int
    rss_mib: float
    cpu_percent: float
    command: str


def sample(cancel: threading.Event | None) -> list[ProcessRow]:
    """Every process readable now: pid, rss MiB, cpu% over SAMPLE seconds, command line."""
    processes = list(psutil.process_iter(["pid", "name", "cmdline", "memory_info"]))
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.cpu_percent(None)
    (cancel or threading.Event()).wait(SAMPLE)
    rows: list[ProcessRow] = []
    for process in processes:
        try:
            cpu = process.cpu_percent(None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        info = process.info
        memory = info["memory_info"]
        command = " ".join(info["cmdline"] or []) or f"[{info['name']}]"
        rows.append(
            {
                "pid": info["pid"],
                "rss_mib": round(memory.rss / MIB, 1) if memory else 0.0,
                "cpu_percent": cpu,
                "command": command[:COMMAND_WIDTH],
            }
        )
    return rows


def table(rows: list[ProcessRow]) -> list[str]:
    if not rows:
        return ["  (none)"]
    cells = [
        [str(row["pid"]), f"{row['rss_mib']:.1f}", f"{row['cpu_percent']:.1f}", row["command"]]
        for row in rows
    ]
    return columns([["PID", "RSS MiB", "CPU%", "COMMAND"], *cells], align=">>><", indent="  ")


def run(params: Params, ctx: TaskContext) -> TaskResult:
    params = ctx.render_params(params)
    if ctx.connection.name != "local":
        return TaskResult(
            ok=False,
            output=f"processes lists this machine's processes, not those of "
            f"{ctx.connection.name}: use a shell task running ps there",
        )
    started = time.monotonic()
    rows = sample(ctx.cancel)
    top = sorted(rows, key=lambda row: row["rss_mib"], reverse=True)[: params.top]
    lines = [f"top {len(top)} processes by memory:", *table(top)]
    matches: list[ProcessRow] = []
    if params.match:
        pattern = re.compile(params.match)
        matches = [row for row in rows if pattern.search(row["command"])]
        lines += [f"processes matching {params.match!r}:", *table(matches)]
    return TaskResult(
        ok=True,
        output="\n".join(lines),
        seconds=time.monotonic() - started,
        data={"top": top, "matches": matches},
    )
