"""`wait: SECONDS`: pause a loop (e.g. let a GPU job finish); wakes at once on shutdown."""

from __future__ import annotations

import threading
import time

from pydantic import NonNegativeFloat

from ralph_runner.actions import TaskContext, TaskResult

KEY = "wait"
AGENT = False  # a pause of the loop itself: nothing to watch
Params = NonNegativeFloat


def describe(params: float, ctx: TaskContext) -> str:
    return f"wait {params:g} s"


def run(params: float, ctx: TaskContext) -> TaskResult:
    started = time.monotonic()
    cancelled = (ctx.cancel or threading.Event()).wait(params)
    return TaskResult(ok=not cancelled, cancelled=cancelled, seconds=time.monotonic() - started)
