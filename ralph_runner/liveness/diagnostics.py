"""Run every collector at once, each under its own timeout: a hung one never holds the rest."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ralph_runner.actions import TaskResult
from ralph_runner.deaths.record import CollectorEntry
from ralph_runner.errors import FatalError
from ralph_runner.runbook import tasks
from ralph_runner.runbook.loader import TaskSpec
from ralph_runner.runbook.plan import Plan

GRACE = 3.0  # beyond a collector's timeout, for killing its process tree


def group_for(plan: Plan) -> tasks.TaskGroup:
    """Collectors run on the target host, each under diagnostics.timeout and max_output."""
    config = plan.model.diagnostics
    return tasks.TaskGroup(plan, timeout=config.timeout, max_output=config.max_output)


def collect(
    specs: list[TaskSpec], group: tasks.TaskGroup, variables: dict[str, Any]
) -> list[CollectorEntry]:
    """One entry per collector (DESIGN §8's keys), in the runbook's order."""
    if not specs:
        return []
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="collector")
    started = time.monotonic()
    futures = [pool.submit(_one, spec, group, dict(variables), cancel) for spec in specs]
    entries = []
    for spec, future in zip(specs, futures, strict=True):
        limit = (spec.task.timeout or group.timeout or 15.0) + GRACE
        remaining = max(0.0, started + limit - time.monotonic())
        try:
            result = future.result(timeout=remaining)
        except TimeoutError:  # a collector that ignores its timeout (e.g. a hung driver call)
            result = TaskResult(ok=False, output="(no answer)", timed_out=True, seconds=limit)
        entries.append(_entry(spec, result))
    cancel.set()
    pool.shutdown(wait=False, cancel_futures=True)
    return entries


def _one(spec: TaskSpec, group: tasks.TaskGroup, variables: dict, cancel) -> TaskResult:
    try:
        return tasks.run(spec, group, variables, cancel)
    except FatalError as exc:  # e.g. an undefined variable: recorded, never fatal here
        return TaskResult(ok=False, output=str(exc))
    except Exception as exc:
        return TaskResult(ok=False, output=f"collector crashed: {exc!r}")


def _entry(spec: TaskSpec, result: TaskResult) -> CollectorEntry:
    return {
        "name": spec.name,
        "ok": result.ok,
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "truncated": result.cut_bytes > 0,
        "cut_bytes": result.cut_bytes,
        "seconds": round(result.seconds, 3),
        "skipped": bool(result.data.get("skipped")),
        "output": result.output,
    }
