"""`loop.workers: N` > 1: up to N checklist items at once, each attempt in its own git worktree.

The main thread schedules (the next items, in checklist order, as workers free up); each
attempt is a thread that runs the runbook's loop steps in its worktree through the same
`Iteration` and task machinery as one worker, then lands or settles it. The rules (docs:
workers): a verified attempt lands as a whole (workspace/worktrees.py); a landing that conflicts
is retried on the new head, no strike, up to CONFLICT_RETRIES times; an attempt that fails while
an earlier item is unsettled waits for them and costs no strike; a death kills every attempt in
flight, is recorded and recovered once, and costs none. Run-wide things (state, status, the
Service, the event bus) are shared, behind `lock` and the Service's own serialization here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, cast

from ralph_runner import events
from ralph_runner.actions import UNWATCHED, TaskResult
from ralph_runner.deaths.record import Facts
from ralph_runner.durable.json_value import JSONObject
from ralph_runner.errors import ExitCode, FatalError
from ralph_runner.liveness.step_watch import Watch
from ralph_runner.loop import failures, governor, idle, limit_hold, pause, proxy
from ralph_runner.loop.attempt import Attempt, AttemptRun, Runner
from ralph_runner.loop.iteration import Iteration, step_entry
from ralph_runner.output import plural
from ralph_runner.process import execute
from ralph_runner.runbook import tasks
from ralph_runner.workspace import checklist, git, worktrees
from ralph_runner.workspace.state_files import STATE_DIR
from ralph_runner.workspace.status_file import Worker

if TYPE_CHECKING:
    from ralph_runner.runbook.loader import TaskSpec
    from ralph_runner.runbook.plan import Plan

CONFLICT_RETRIES = 3  # conflicting landings of one item retried before one counts as a failure
NO_METRICS = (
    "workers: auto reads the server's /metrics: add a `progress` probe, "
    "or give loop.governor.metrics"
)
JOIN_SECONDS = 30.0  # how long a stop waits for the attempts' threads (their trees are killed)


class Pool:
    """The workers of one run: the scheduler (`run`, the main thread) and its attempts."""

    def __init__(self, runner: Runner, workers: int, auto: bool = False) -> None:
        """`workers`: at most this many at once; `auto`: as many as the governor admits."""
        self.runner, self.size = runner, workers
        self.admitted = 1 if auto else workers  # the attempts that may be in flight now
        self.governor = governor.Governor(
            runner.model.loop.governor, metrics_url(runner), workers, self, runner.bus,
            runner.health.client,
        ) if auto else None  # fmt: skip
        self.workdir = runner.plan.workdir
        self.top = git.top(self.workdir)
        self.lock = threading.RLock()  # the schedule, the state's counters, the checklist
        self.changed = threading.Condition(self.lock)
        self.service_lock = threading.Lock()  # one health check or recovery at a time
        self.landing = threading.Lock()  # one landing (or skip commit) at a time
        self.attempts: dict[int, Attempt] = {}  # worker -> its attempt in flight
        self.waiting: set[str] = set()  # items that wait for the earlier ones to settle
        self.conflicts: dict[str, int] = {}
        self.error: BaseException | None = None  # what ended the run in a worker's thread
        self.begun = 0  # attempts started (max_iterations counts them as they start)
        self.recovering = False  # a death is being recorded and recovered: start nothing
        self.hold = limit_hold.Hold()  # a usage limit: start nothing until its reset
        self.checklist_rel = str(runner.checklist_path.resolve().relative_to(self.top))
        self.workdir_rel = self.workdir.resolve().relative_to(self.top)

    # -- the scheduler -------------------------------------------------------------------------
    def run(self) -> int:
        """Until every item is settled (or max_iterations); the run's exit code."""
        runner = self.runner
        for left in worktrees.stale(self.top):
            runner.bus.warn(f"removed what a killed run left: {left}")
        runner.bus.follow(self)  # a Death kills every attempt in flight
        if self.governor is not None:
            runner.bus.follow(self.governor)  # a KV-pressure death sheds one
            self.governor.start()
        try:
            return self._schedule()
        finally:
            if self.governor is not None:
                self.governor.stop()
            self._halt()

    def in_flight(self) -> int:
        return len(self.attempts)

    def admit(self, workers: int) -> None:
        """The governor's decision: at most `workers` in flight from now (none is killed)."""
        with self.changed:
            self.admitted = workers
            self.changed.notify_all()
        self.runner.save(status_only=True)

    def _schedule(self) -> int:
        runner, st = self.runner, self.runner.state
        limit = runner.model.loop.max_iterations
        before = st.iteration - st.run_from  # this run's iterations before the workers began
        with self.changed:
            while True:
                runner.signals.raise_pending()
                if self.error is not None:
                    raise self.error
                text = checklist.read(runner.checklist_path)
                todo = [i for i in checklist.parse(text) if i.mark == checklist.TODO]
                at_limit = bool(limit) and before + self.begun >= limit
                if not todo and not self.attempts:
                    runner.summary(text)
                    return ExitCode.DONE
                if at_limit and not self.attempts:
                    runner.summary(text, stopped=True)
                    return ExitCode.MAX_ITERATIONS
                if self._paused() or self._told():
                    continue
                started = False
                held = self.hold.left() is not None
                while (
                    not (at_limit or held or self.recovering) and len(self.attempts) < self.admitted
                ):
                    item = self._next(todo)
                    if item is None:
                        break
                    self._start(item, todo)
                    started = True
                    at_limit = bool(limit) and before + self.begun >= limit
                if not started:
                    self.changed.wait(timeout=1.0)  # woken by an attempt's end; 1 s: signals

    def _room(self) -> bool:
        return len(self.attempts) < self.admitted

    def _paused(self) -> bool:
        """`ralph-run pause`: start nothing more; with --now, stop the attempts in flight; once
        none is, hold the run as one worker's loop does (the pause and resume blocks)."""
        wanted = pause.read(self.runner.pause.path)
        if wanted is None:
            return False
        if wanted.get("now"):
            for attempt in self.attempts.values():
                attempt.paused = True
                self._kill(attempt)
        if self.attempts:
            self.changed.wait(timeout=1.0)
            return True
        self.lock.release()  # the hold saves and emits: never under the pool's lock
        try:
            self.runner.pause.hold(wanted)
        finally:
            self.lock.acquire()
        return True

    def _told(self) -> bool:
        """A usage limit's countdown, or its end (state saved), said outside the pool's lock
        (an emit under it could wait on a thread that holds the bus and wants the pool)."""
        self.lock.release()
        try:
            changed = self.hold.tell(self.runner.bus, self.runner.state)
            if changed:
                self.runner.save()
        finally:
            self.lock.acquire()
        return changed

    @staticmethod
    def _kill(attempt: Attempt) -> None:
        attempt.killed.set()
        if attempt.step_cancel is not None:
            attempt.step_cancel.set()

    def _next(self, todo: list[checklist.Item]) -> checklist.Item | None:
        """The first item not in flight whose turn it is: a waiting one only once every item
        before it is settled."""
        busy = {a.item.text for a in self.attempts.values()}
        for item in todo:
            if item.text in busy:
                continue
            if item.text in self.waiting:
                if any(other.index < item.index for other in todo):
                    continue
                self.waiting.discard(item.text)
            return item
        return None

    def _start(self, item: checklist.Item, todo: list[checklist.Item]) -> None:
        worker = next(n for n in range(1, self.size + 1) if n not in self.attempts)  # lowest free
        strikable = not any(other.index < item.index for other in todo)
        runner = self.runner
        attempt = Attempt(worker, item, strikable, runner.state.deaths, runner.health.restarts()[0])
        self.attempts[worker] = attempt
        self.begun += 1
        attempt.thread = threading.Thread(
            target=self._attempt, args=(attempt,), name=f"worker-{worker}", daemon=True
        )
        attempt.thread.start()

    # -- one attempt (its own thread) ----------------------------------------------------------
    def _attempt(self, attempt: Attempt) -> None:
        try:
            self._work(attempt)
        except BaseException as exc:  # GaveUp, a template's FatalError, a bug: the run ends
            with self.lock:
                if self.error is None:
                    self.error = exc
            if attempt.iteration is not None:  # outside the lock: a Death's emit takes it
                attempt.iteration.cut_short(exc)
        finally:
            if attempt.tree is not None:
                with self.landing:
                    worktrees.remove(self.top, attempt.tree)
            with self.changed:
                self.attempts.pop(attempt.worker, None)
                self.changed.notify_all()
            self.runner.save()

    def _work(self, attempt: Attempt) -> None:
        runner, st = self.runner, self.runner.state
        with self.landing:  # a worktree from a head no landing is moving
            attempt.tree = worktrees.add(self.top, attempt.worker, attempt.item.text)
        workdir = attempt.tree.path / self.workdir_rel
        run = AttemptRun(self, attempt, workdir, attempt.tree.path / self.checklist_rel)
        before = run.snapshot()
        label = proxy.worker_label(attempt.worker)  # its agent's own proxy URL: its receipts
        meter = runner.proxy
        ours = (lambda: meter.in_flight(label) > 0) if meter is not None else None
        extra = {**proxy.variables(runner.plan, runner.proxy, label), "workdir": str(workdir)}
        with self.lock:  # its number and its variables' (iteration, checklist) agree
            st.iteration += 1
            it = attempt.iteration = Iteration(run, attempt.item, before)
            variables = it.render(runner.checklist_counts(), extra)
        runner.bus.emit(
            events.WorkerStarted(
                worker=attempt.worker,
                iteration=it.number,
                item=attempt.item.text,
                branch=attempt.tree.branch,
                base=attempt.tree.base,
                strikable=attempt.strikable,
            )
        )
        runner.bus.emit(it.started())
        runner.save()  # its number: a rerun after kill -9 goes on from it
        group = tasks.TaskGroup(
            runner.plan,
            connection=runner.plan.controller(),
            cwd=workdir,
            run=run,
            on_output=run.show_output if runner.bus.verbose else None,
            # the worktree's files (its own .ralph/ left out, none: the run's is above it)
            idle=idle.watches(runner.plan, runner.health, workdir / STATE_DIR, workdir, ours),
        )
        for spec in runner.plan.runbook.loop_steps:
            if attempt.killed.is_set() or self._stopping():
                break
            if it.failed_step and spec.kind != "ensure_alive":
                continue
            it.took(spec, self._step(attempt, spec, group, variables))
            run.flush_output()
        if it.failed_step and not attempt.killed.is_set() and runner.plan.runbook.probes:
            runner.stop.wait(max(runner.model.health.interval, 1.0))
            self.ensure_service(attempt, "after-failure", None)
            self._account_for(attempt)
        if self._stopping():  # a signal killed its steps: no outcome, the item comes again
            it.end("interrupted")
            return
        self._settle(attempt, it)

    def _stopping(self) -> bool:
        return self.runner.signals.pending is not None or self.error is not None

    def _step(
        self, attempt: Attempt, spec: TaskSpec, group: tasks.TaskGroup, variables: dict[str, object]
    ) -> TaskResult:
        runner = self.runner
        attempt.phase = spec.name
        runner.save(status_only=True)
        runner.bus.emit(events.Step(step=spec.name, action=spec.kind, worker=attempt.worker))
        started = time.monotonic()
        every = runner.model.health.watch if runner.plan.runbook.probes else 0
        if spec.kind in UNWATCHED:
            every = 0
        number = attempt.iteration.number if attempt.iteration else 0
        with (
            Watch(runner.health, every, number) as watch,
            # an agent's work leaves nothing running (the sweep's marker is this thread's)
            execute.swept() if spec.kind not in UNWATCHED else contextlib.nullcontext() as swept,
        ):
            with self.lock:
                attempt.step_cancel = watch.cancel
                if attempt.killed.is_set():
                    watch.cancel.set()
            result = tasks.run(spec, group, variables, watch.cancel)
            attempt.step_cancel = None
        if swept is not None and swept.killed:
            left = plural(len(swept.killed), "process")
            runner.bus.warn(f"{spec.name} left {left} running: killed {', '.join(swept.killed)}")
        status = "ok"
        if not result.ok:
            status = failures.status_text(
                result.exit_code, result.timed_out, result.cancelled, result.output, result.stalled
            )
        runner.bus.emit(
            events.StepDone(
                step=spec.name,
                ok=result.ok,
                exit_code=result.exit_code,
                timed_out=result.timed_out,
                killed=result.cancelled,
                stalled=bool(result.stalled),
                status=status,
                seconds=round(time.monotonic() - started, 3),
                worker=attempt.worker,
            )
        )
        if watch.rounds is not None:
            runner.bus.emit(events.Watch(step=spec.name, killed=True))
            facts = {**self._facts(attempt), "step": step_entry(spec, result, runner.redactor)}
            self._died(attempt, "during-step", watch.rounds, cast("Facts", facts))
        return result

    # -- the service, shared -------------------------------------------------------------------
    def ensure_service(
        self, attempt: Attempt, phase: str, context: dict[str, object] | None
    ) -> None:
        """One check at a time; a death the run recorded since the attempt began is not
        recorded again (it killed this attempt too)."""
        facts = self._facts(attempt)
        if context:
            facts["context"] = cast("JSONObject", context)
        with self.service_lock:
            if self.runner.state.deaths != attempt.epoch:
                return
            number = attempt.iteration.number if attempt.iteration else None
            try:
                self.runner.service.ensure_alive(phase, facts, number)
            finally:
                self._recovered()
        self.runner.forget_counts()

    def _account_for(self, attempt: Attempt) -> None:
        """As one worker's loop (Runner._account_for): a failed attempt during which another
        server came to answer is a death of its own, recorded once for every worker; work
        waiting with no progress is watched until the probes' stall window decides."""
        runner = self.runner
        health, interval = runner.health, runner.model.health.interval
        with self.service_lock:
            restarts, evidence = health.restarts()
            if runner.state.deaths == attempt.epoch and restarts > attempt.restarts:
                try:
                    facts = self._facts(attempt)
                    runner.service.restarted("after-failure", evidence or "a new server", facts)
                finally:
                    self._recovered()
                return
        limit = time.monotonic() + health.stall_window() + 2 * runner.model.health.watch
        while runner.state.deaths == attempt.epoch and health.waiting_since() is not None:
            if time.monotonic() > limit or runner.stop.wait(interval):
                return
            self.ensure_service(attempt, "after-failure", None)

    def _died(self, attempt: Attempt, phase: str, rounds: list, facts: Facts) -> None:
        with self.service_lock:
            if self.runner.state.deaths != attempt.epoch:
                return  # recorded by another worker's watch: one death, one recovery
            try:
                self.runner.service.died(phase, rounds, facts)
            finally:
                self._recovered()

    def _recovered(self) -> None:
        with self.changed:
            self.recovering = False
            self.changed.notify_all()

    def on_event(self, event: events.Event) -> None:
        """A death (said before its capture and recovery) kills every attempt in flight."""
        if isinstance(event, events.Death):
            with self.lock:
                self.recovering = True
                for attempt in self.attempts.values():
                    self._kill(attempt)

    def _facts(self, attempt: Attempt) -> Facts:
        it = attempt.iteration
        counts = self.runner.checklist_counts()
        return {
            "iteration": it.number if it else self.runner.state.iteration,
            "item": it.entry if it else None,
            **(Facts(step=it.failed_step) if it and it.failed_step else Facts()),
            "prompt_size": len(it.prompt) if it else None,
            "prompt_bytes": it.prompt_bytes if it else None,
            "checklist": counts.as_dict(),
            "variables": {**(it.variables if it else {}), "checklist": counts.as_dict()},
        }

    # -- its end -------------------------------------------------------------------------------
    def _settle(self, attempt: Attempt, it: Iteration) -> None:
        """Land it, or retry it with no strike (a death, a conflict, an earlier item
        unsettled), or strike it (and skip it at `strikes`)."""
        bus, item, st = self.runner.bus, attempt.item, self.runner.state
        if attempt.paused:
            it.end("paused")  # no outcome counted: the item comes again after `resume`
            return
        killed = attempt.killed.is_set() or st.deaths != attempt.epoch
        if killed and (it.failed_step is not None or attempt.killed.is_set()):
            reason = it.failed_step["reason"] if it.failed_step else "the service died"
            bus.emit(events.Retry(item=item.text, reason=reason))
            bus.emit(events.WorkerRetry(worker=attempt.worker, item=item.text,
                                        reason="the service died", waits=False))  # fmt: skip
            it.end("death", reason=reason)
            return
        if it.failed_step is None:
            self._land(attempt, it)
            return
        if (wait := it.limited()) is not None:  # Limited raised when beyond limits.max_wait
            with self.changed:  # no strike; every worker waits for the reset
                self.hold.extend(item.text, wait)
                self.changed.notify_all()
            return
        if not attempt.strikable:
            with self.lock:
                self.waiting.add(item.text)
            reason = "an earlier item was in flight or unlanded when it started"
            bus.emit(events.WorkerRetry(worker=attempt.worker, item=item.text,
                                        reason=reason, waits=True))  # fmt: skip
            it.end("deferred", reason=it.failed_step["reason"])
            return
        it.charge(it.failure(it.failed_step))  # the broken-agent rule: AgentBroken ends the run
        self._strike(attempt, it, it.failed_step["reason"], it.failed_step["output_tail"])

    def _land(self, attempt: Attempt, it: Iteration) -> None:
        assert attempt.tree is not None
        attempt.phase = "landing"
        item = attempt.item
        with self.landing:
            try:
                landing = worktrees.land(self.top, attempt.tree, self.checklist_rel, item.text)
            except worktrees.GitFailed as exc:
                landing = worktrees.Landing(None, 0, str(exc)[:300])
        st, bus = self.runner.state, self.runner.bus
        if landing.head is not None:
            with self.lock:
                st.strikes.pop(item.text, None)
                self.conflicts.pop(item.text, None)
                st.last_failure, st.streak_skipped = None, []  # the agent works
                self.hold.since = None
                self.runner.forget_counts()
            bus.emit(events.WorkerLanded(worker=attempt.worker, item=item.text,
                                         commits=landing.commits, head=landing.head))  # fmt: skip
            bus.emit(events.Done(item=item.text))
            it.end("done")
            return
        with self.lock:
            conflicts = self.conflicts[item.text] = self.conflicts.get(item.text, 0) + 1
        bus.emit(events.WorkerConflict(worker=attempt.worker, item=item.text, conflicts=conflicts,
                                       of=CONFLICT_RETRIES, reason=landing.reason))  # fmt: skip
        if conflicts <= CONFLICT_RETRIES:
            it.end("conflict", reason=landing.reason)
            return
        with self.lock:
            self.conflicts.pop(item.text, None)
        self._strike(attempt, it, f"its landing conflicted {conflicts} times", landing.reason)

    def _strike(self, attempt: Attempt, it: Iteration, reason: str, tail: str) -> None:
        runner, st, item = self.runner, self.runner.state, attempt.item
        with self.lock:
            strikes = st.strikes[item.text] = st.strikes.get(item.text, 0) + 1
        most = runner.model.checklist.strikes
        runner.bus.emit(events.Strike(item=item.text, strikes=strikes, of=most,
                                      reason=reason, output_tail=tail))  # fmt: skip
        if strikes < most:
            it.end("strike", reason=reason, strikes=strikes)
            return
        with self.landing, self.lock:
            text = checklist.read(runner.checklist_path)
            current = checklist.find(text, item.text)
            if current is not None:
                checklist.write(
                    runner.checklist_path, checklist.mark(text, current, checklist.SKIPPED)
                )
                message = f"skip: {item.text} ({strikes} failures)"
                git.commit_paths(runner.plan.workdir, message, runner.checklist_path)
            st.strikes.pop(item.text, None)
            st.streak_skipped.append(item.text)  # AgentBroken names the items skipped meanwhile
            runner.forget_counts()
        runner.bus.emit(events.Skip(item=item.text, strikes=strikes))
        it.end("skipped", reason=reason, strikes=strikes)

    # -- the stop ------------------------------------------------------------------------------
    def _halt(self) -> None:
        """Every attempt killed and joined, its worktree and branch removed; nothing landed
        half (a landing is one fast-forward)."""
        with self.lock:
            attempts = list(self.attempts.values())
            for attempt in attempts:
                self._kill(attempt)
        execute.kill_all()
        deadline = time.monotonic() + JOIN_SECONDS
        for attempt in attempts:
            if attempt.thread is not None:
                attempt.thread.join(max(0.0, deadline - time.monotonic()))
        execute.kill_all()
        try:
            worktrees.stale(self.top)
        except (worktrees.GitFailed, FatalError) as exc:
            self.runner.bus.warn(f"worktrees not cleaned: {exc}")

    def statuses(self) -> list[Worker]:
        """status.json's `workers`: each worker's item and phase. Without the pool's lock (a
        copy of the dict): a save may come from a thread that holds the bus or the Service."""
        attempts = dict(self.attempts)
        found: list[Worker] = []
        for n in range(1, self.size + 1):
            attempt = attempts.get(n)
            if attempt is None and n > self.admitted:
                continue  # not admitted now (workers: auto)
            found.append({
                "worker": n,
                "item": attempt.item.text if attempt else None,
                "phase": attempt.phase if attempt else None,
            })  # fmt: skip
        return found


def metrics_url(runner: Runner) -> str:
    """Where `workers: auto` looks: `loop.governor.metrics`, else the `progress` probe's."""
    given = runner.model.loop.governor.metrics
    if given:
        return runner.plan.templar.render(given, runner.plan.variables)
    for spec in runner.health.probes:
        if spec.kind == "progress":
            return str(spec.params.metrics)
    raise FatalError(NO_METRICS)


def check_auto(plan: Plan) -> None:
    """At preflight (before the setup blocks run): `workers: auto` has a /metrics to read."""
    given = plan.model.loop.governor.metrics
    if not given and not any(probe.kind == "progress" for probe in plan.runbook.probes):
        raise FatalError(NO_METRICS)
