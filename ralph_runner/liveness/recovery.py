"""Bring the service back: steps with attempts, delay and backoff, then wait for health."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from ralph_runner import events
from ralph_runner.actions import TaskResult
from ralph_runner.deaths.record import RecoveryStep
from ralph_runner.liveness import faults
from ralph_runner.liveness.health import Health
from ralph_runner.probes import ProbeResult
from ralph_runner.runbook import tasks
from ralph_runner.runbook.loader import TaskSpec
from ralph_runner.runbook.schema import Recovery


class ProbeFacts(TypedDict):
    """One probe's result as recovery steps see it (`death.probes`)."""

    name: str
    kind: str
    ok: bool
    reason: str | None
    detail: str


class DeathFacts(TypedDict):
    """What recovery steps see as `death` (schema.DEATH_FIELDS: the loader checks `when:`
    against them)."""

    number: int
    phase: str
    time: str
    probes: list[ProbeFacts]
    reasons: list[str]
    hung: bool
    fault: str


HUNG = {"stalled", "timeout"}  # up, but not doing its work: stop it before starting another
# `death` as `--check` renders recovery steps with it (the real one exists only at a death)
SAMPLE_DEATH: DeathFacts = {
    "number": 1,
    "phase": "during-step",
    "time": "<time of the death>",
    "probes": [],
    "reasons": [],
    "hung": False,
    "fault": "server gone",
}


@dataclass
class Outcome:
    recovered: bool
    attempts: int
    seconds: float
    reason: str | None = None
    steps: list[RecoveryStep] = field(default_factory=list)
    by: str | None = None  # healthy again with no step of ours: who (or what) brought it back


def death_of(
    number: int, phase: str, time: str, results: list[ProbeResult], fault: str | None = None
) -> DeathFacts:
    """What recovery steps see as `death`: which death, when, how the probes failed, and the
    fault's class (faults.py)."""
    reasons = sorted({r.reason for r in results if not r.ok and r.reason})
    probes: list[ProbeFacts] = [
        {"name": r.name, "kind": r.kind, "ok": r.ok, "reason": r.reason, "detail": r.detail}
        for r in results
    ]
    return {
        "number": number,
        "phase": phase,
        "time": time,
        "probes": probes,
        "reasons": reasons,
        "hung": bool(HUNG.intersection(reasons)),
        "fault": fault or faults.classify(results)[0],
    }


def recover(
    config: Recovery,
    specs: list[TaskSpec],
    group: tasks.TaskGroup,
    variables: dict[str, object],
    health: Health,
    stop: threading.Event,
    emit: Callable[[events.Event], None] = lambda event: None,
) -> Outcome:
    """One attempt = the steps in order (a failing step ends it), then probes until healthy.
    `emit` hears each step start (`recovery-step`) and each failed attempt with the wait
    before the next (`recovery-failed`, `retry_in` None after the last)."""
    started = time.monotonic()
    steps: list[RecoveryStep] = []
    reason = None
    for attempt in range(1, config.attempts + 1):

        def starting(spec: TaskSpec, skipped: str | None, attempt: int = attempt) -> None:
            emit(events.RecoveryStep(attempt=attempt, step=spec.name, skipped=skipped or None))

        ran = tasks.run_steps(specs, group, variables, stop, starting)
        steps += [_step(attempt, spec, result) for spec, result in ran.results]
        failed = ran.failure
        if failed is None:
            healthy, _ = health.wait_healthy(config.healthy_within, cancel=stop)
            if healthy:
                return Outcome(True, attempt, time.monotonic() - started, None, steps)
            failed = f"not healthy within {config.healthy_within:g} s after the steps"
        reason = f"{failed} (attempt {attempt} of {config.attempts})"
        last = attempt == config.attempts
        pause = None if last else config.delay * config.backoff ** (attempt - 1)
        emit(events.RecoveryFailed(attempt=attempt, reason=failed, retry_in=pause))
        if pause is not None and stop.wait(pause):
            break
    return Outcome(False, config.attempts, time.monotonic() - started, reason, steps)


def _step(attempt: int, spec: TaskSpec, result: TaskResult) -> RecoveryStep:
    return {
        "attempt": attempt,
        "name": spec.name,
        "ok": result.ok,
        "skipped": bool(result.data.get("skipped")),  # its `when:` was false
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "seconds": round(result.seconds, 3),
        "output": "\n".join(result.output.splitlines()[-10:]),
    }
