"""What every attempt runs, one worker or many: the loop steps under the watch, the check after a
failure, the accounting of a failed attempt, and the service's checks, one at a time.

A step runs under a `Watch` (a health check every `health.watch` s; a death cancels it) and, if
it runs processes, a sweep (an agent's work leaves nothing running). After a failure only
`ensure_alive` steps run: a death must still be seen. A failed attempt is the item's only if the
service was the same server and healthy through it (`_account_for`); the Iteration then settles
it (iteration.py). Every service check takes `service_lock`: one check or recovery at a time,
and a death the watch of another attempt's step recorded meanwhile is not recorded twice."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from ralph_runner import events
from ralph_runner.actions import KINDS, UNWATCHED, TaskResult
from ralph_runner.deaths.record import Facts
from ralph_runner.durable.json_value import JSONObject
from ralph_runner.liveness.step_watch import Watch
from ralph_runner.loop import failures, idle, proxy
from ralph_runner.loop.iteration import Attempt, Iteration, Landing, step_entry
from ralph_runner.output.text import plural
from ralph_runner.process import execute
from ralph_runner.runbook import tasks
from ralph_runner.workspace.state_files import STATE_DIR

if TYPE_CHECKING:
    from ralph_runner.loop.context import RunContext
    from ralph_runner.loop.limit_hold import Hold
    from ralph_runner.probes import ProbeResult
    from ralph_runner.runbook.loader import TaskSpec

SETTLE = 1.0  # seconds a failed attempt waits before its after-failure health check
# What each action kind declares of itself (actions/__init__.py): no kind is named here.
QUICK = frozenset(key for key, kind in KINDS.items() if getattr(kind, "QUICK", False))


class Work:
    """The steps of one attempt and the service checks of all of them (see the module)."""

    def __init__(
        self,
        run: RunContext,
        landing: Landing,
        hold: Hold,
        recovered: Callable[[], None],
        show_bound: Callable[[], None],
    ) -> None:
        """`recovered`: after each service call (a death's recovery is over); `show_bound`: after
        each watch round (status.json follows the hang bound mid-step)."""
        self.run, self.landing, self.hold = run, landing, hold
        self.recovered, self.show_bound = recovered, show_bound
        self.service_lock = threading.Lock()
        self.last: Attempt | None = None  # the attempt in hand, or the last one begun

    # -- one attempt ---------------------------------------------------------------------------
    def attempt(self, attempt: Attempt) -> None:
        """Its steps, the after-failure look, its outcome (the Iteration's); raises what ends
        the run (GaveUp, AgentBrokenError, LimitedError, a signal's Interrupted)."""
        run, st = self.run, self.run.state
        before = self.landing.prepare(attempt)
        label = None if attempt.alone else proxy.worker_label(attempt.worker)
        extra = proxy.variables(run.plan, run.proxy, label)  # a worker's own URL: its receipts
        with self.run.lock:  # its number and its variables' (iteration, checklist) agree
            st.iteration += 1
            if attempt.alone:
                st.current_item, st.phase = attempt.item.text, None
            it = attempt.iteration = Iteration(run, attempt, before, self.landing, self.hold)
            variables = it.render(run.counts.get(), {**extra, **self.landing.variables(attempt)})
            self.last = attempt
        self.landing.began(attempt)
        run.bus.emit(it.started())
        run.save()  # its number: a rerun after kill -9 goes on from it
        meter = run.proxy
        ours = None  # a worker's agent is idle when no request of its own is in flight
        if meter is not None and label is not None:
            ours = lambda: meter.in_flight(label) > 0  # noqa: E731
        group = tasks.TaskGroup(
            run.plan,
            connection=run.plan.controller(),
            cwd=attempt.workdir,
            run=attempt,
            on_output=(lambda text: self._show_output(attempt, text)) if run.bus.verbose else None,
            idle=idle.watches(
                run.plan, run.health, attempt.workdir / STATE_DIR, attempt.workdir, ours
            ),
        )
        restarts_before = run.health.restarts()[0]
        for spec in run.plan.runbook.loop_steps:
            if attempt.killed.is_set():
                break
            if it.failed_step and spec.kind != "ensure_alive":
                continue  # after a failure only health checks run: a death must still be seen
            it.took(spec, self._step(attempt, spec, group, variables))
            if attempt.paused:
                it.end("paused")  # no outcome counted: the item comes again after `resume`
                return
        if it.failed_step and not it.died() and run.plan.runbook.probes:
            # A dying server may still answer for a moment after failing the agent's call
            # (vLLM's /v1/models answers 200 for ~0.3 s after its engine died, then the API
            # server exits): look again, at least SETTLE s later, before blaming the item.
            run.stop.wait(max(run.model.health.interval, SETTLE))
            self.ensure_service(attempt, "after-failure")
            self._account_for(attempt, restarts_before)
        run.signals.raise_pending()
        if attempt.killed.is_set():  # the run stops: no outcome, the item comes again
            it.end("interrupted")
            return
        it.settle()

    def _step(
        self, attempt: Attempt, spec: TaskSpec, group: tasks.TaskGroup, variables: dict[str, object]
    ) -> TaskResult:
        run = self.run
        attempt.at(spec.name)
        if spec.kind not in QUICK:
            run.save_status()  # for people watching; the state has not moved
        run.bus.emit(events.Step(step=spec.name, action=spec.kind, worker=attempt.label))
        started = time.monotonic()
        watched = spec.kind not in UNWATCHED
        every = run.model.health.watch if run.plan.runbook.probes and watched else 0
        deaths = run.state.deaths
        number = attempt.iteration.number if attempt.iteration else run.state.iteration
        with (
            Watch(run.health, every, number, self.show_bound) as watch,
            # an agent's work leaves nothing running (a recovery's server must outlive its step;
            # the sweep's marker is this thread's)
            execute.swept() if watched else contextlib.nullcontext() as swept,
        ):
            with self.run.lock:
                attempt.step_cancel = watch.cancel
                attempt.agent_step = spec.name if watched else None
                attempt.sent = attempt.sent or watched
                if attempt.killed.is_set():
                    watch.cancel.set()
            try:
                result = tasks.run(spec, group, variables, watch.cancel)
            finally:
                with self.run.lock:
                    attempt.step_cancel, attempt.agent_step = None, None
        if swept is not None and swept.killed:
            left = plural(len(swept.killed), "process")
            run.bus.warn(f"{spec.name} left {left} running: killed {', '.join(swept.killed)}")
        if watched:
            run.counts.forget()  # the agent may have ticked its item
        run.signals.raise_pending()  # the step was killed by a signal: no strike for it
        if attempt.paused:
            return result  # `pause --now` killed it: no outcome, no step line
        self._flush_output(attempt)
        status = "ok"
        if not result.ok:
            status = failures.status_text(
                result.exit_code, result.timed_out, result.cancelled, result.output, result.stalled
            )
        run.bus.emit(
            events.StepDone(
                step=spec.name,
                ok=result.ok,
                exit_code=result.exit_code,
                timed_out=result.timed_out,
                killed=result.cancelled,
                stalled=bool(result.stalled),
                status=status,
                seconds=round(time.monotonic() - started, 3),
                worker=attempt.label,
            )
        )
        if watch.rounds is not None:
            run.bus.emit(events.Watch(step=spec.name, killed=True))
            facts = {**self.facts(attempt), "step": step_entry(spec, result, run.redactor)}
            self._died(deaths, "during-step", watch.rounds, cast("Facts", facts))
        return result

    def _show_output(self, attempt: Attempt, text: str) -> None:
        """`-v`: the step's output, a line at a time (it arrives in arbitrary chunks), without
        the escape codes that would garble a log file or move a terminal's cursor."""
        for line in attempt.lines.feed(text):  # a line over 64 KiB comes in cut pieces
            self.run.bus.emit(events.Output(step=attempt.phase, text=line))

    def _flush_output(self, attempt: Attempt) -> None:
        if (last := attempt.lines.end()) is not None:
            self.run.bus.emit(events.Output(step=attempt.phase, text=last))

    def _account_for(self, attempt: Attempt, restarts_before: int) -> None:
        """A failed attempt with a healthy service now is the item's only if the service was
        the same server and made progress (or idled) through it: a restart by someone else is
        a death of its own, recorded once for every worker; work that waits with no progress
        is watched until the probes' stall window decides (a step that timed out before the
        hang bound ran out)."""
        run, it = self.run, attempt.iteration
        assert it is not None
        health = run.health
        with self.service_lock:
            restarts, evidence = health.restarts()
            if not it.died() and restarts > restarts_before:
                try:
                    facts = self.facts(attempt)
                    run.service.restarted("after-failure", evidence or "a new server", facts)
                finally:
                    self.recovered()
                return
        limit = time.monotonic() + health.stall_window() + 2 * run.model.health.watch
        while not it.died() and health.waiting_since() is not None:
            if time.monotonic() > limit or run.stop.wait(run.model.health.interval):
                return
            self.ensure_service(attempt, "after-failure")

    # -- the service, shared -------------------------------------------------------------------
    def ensure_service(
        self, attempt: Attempt | None, phase: str, context: dict[str, object] | None = None
    ) -> None:
        """Healthy, or recovered (GaveUp when it cannot be); `attempt` None: between attempts
        (the pause's resume)."""
        run = self.run
        if attempt is None or attempt.alone:
            run.state.phase = phase
        facts = self.facts(attempt)
        if context:  # an ensure_alive step's rendered YAML: JSON values
            facts["context"] = cast("JSONObject", context)
        it = attempt.iteration if attempt else None
        number = it.number if it else run.state.iteration
        with self.service_lock:
            deaths = run.state.deaths
            try:
                run.service.ensure_alive(phase, facts, number)
            finally:
                self.recovered()
        if run.state.deaths != deaths:
            run.counts.forget()  # recovery steps ran

    def _died(self, deaths: int, phase: str, rounds: list[list[ProbeResult]], facts: Facts) -> None:
        """A death the step's watch confirmed, unless the run recorded one since the step began:
        another attempt's watch saw the same death (one death, one recovery)."""
        with self.service_lock:
            if self.run.state.deaths != deaths:
                return
            try:
                self.run.service.died(phase, rounds, facts)
            finally:
                self.recovered()

    def facts(self, attempt: Attempt | None) -> Facts:
        """What a death record knows of the loop: the attempt's item, variables and failed step;
        between attempts, the last one's (a death at `resume` is in its wake)."""
        attempt = attempt or self.last
        it = attempt.iteration if attempt else None
        counts = self.run.counts.get()
        return {
            "iteration": it.number if it else self.run.state.iteration,
            "item": it.entry if it else None,
            **(Facts(step=it.failed_step) if it and it.failed_step else Facts()),
            "prompt_size": len(it.prompt) if it else None,
            "prompt_bytes": it.prompt_bytes if it else None,
            "checklist": counts.as_dict(),
            "variables": {**(it.variables if it else {}), "checklist": counts.as_dict()},
        }
