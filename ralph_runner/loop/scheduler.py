"""The one scheduler of attempts: `loop.workers: 1` is a pool of one that works in place; N > 1
work in git worktrees (landing.py, docs: workers).

The main thread schedules: the next items in checklist order, as workers free up, each attempt
a thread that runs the runbook's loop steps (steps.py) and settles its Iteration. Between its
rounds it answers what holds the run: `ralph-run pause` (said while attempts are in flight,
`--now` kills their agent steps, held once none is), a usage limit (nothing starts until the
reset: limit_hold.py), a death's recovery (nothing starts until it is over). Order: an item that
waits for the ones before it to settle starts only once they have; an attempt is strikable only
if every item above it was settled when it started. A death is one death for all: the service
calls `on_death`, which kills the agent steps in flight (each item retried, no strike); a signal,
an error or a worker's GaveUp stops every attempt, joined, its worktree removed.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ralph_runner.errors import ExitCode, FatalError
from ralph_runner.loop import governor, limit_hold, pause
from ralph_runner.loop.iteration import Attempt
from ralph_runner.loop.landing import for_workers
from ralph_runner.loop.rejuvenation import Rejuvenation
from ralph_runner.loop.steps import Work
from ralph_runner.process import execute
from ralph_runner.workspace import checklist, worktrees
from ralph_runner.workspace.status_file import Worker

if TYPE_CHECKING:
    from collections.abc import Callable

    from ralph_runner.deaths.record import Blame as Blamed
    from ralph_runner.loop.context import RunContext
    from ralph_runner.runbook.plan import Plan

NO_METRICS = "{what} reads the server's /metrics: add a `progress` probe, or give {where}"
JOIN_SECONDS = 30.0  # how long a stop waits for the attempts' threads (their trees are killed)


class Scheduler:
    """The attempts of one run (see the module)."""

    def __init__(
        self,
        run: RunContext,
        paused: pause.Pause,
        workers: int,
        auto: bool,
        show_bound: Callable[[], None],
        summary: Callable[[str, bool], None],
    ) -> None:
        """`workers`: at most this many at once; `auto`: as many as the governor admits;
        `show_bound`: after each watch round; `summary`: the run's last word, its checklist's
        text and whether max_iterations stopped it."""
        self.run, self.pause, self.size, self.summary = run, paused, workers, summary
        self.admitted = 1 if auto else workers  # the attempts that may be in flight now
        settings = run.model.loop.governor
        self.governor = governor.Governor(
            settings, metrics_url(run, settings.metrics), workers, self.in_flight, self.admit,
            run.bus, run.health.client,
        ) if auto else None  # fmt: skip
        rejuvenate = run.model.health.rejuvenate
        self.rejuvenation = Rejuvenation(
            run, rejuvenate, metrics_url(run, rejuvenate.metrics), self.items_in_flight
        ) if rejuvenate is not None else None  # fmt: skip
        self.landing = for_workers(run, workers)
        self.changed = threading.Condition(run.lock)
        self.hold = limit_hold.Hold()  # a usage limit: start nothing until its reset
        self.work = Work(run, self.landing, self.hold, self._recovered, show_bound)
        self.attempts: dict[int, Attempt] = {}  # worker -> its attempt in flight
        self.waiting: set[str] = set()  # items that wait for the earlier ones to settle
        self.error: BaseException | None = None  # what ended the run in a worker's thread
        self.begun = 0  # attempts started (max_iterations counts them as they start)
        self.recovering = False  # a death is being recorded and recovered: start nothing

    # -- the schedule --------------------------------------------------------------------------
    def run_all(self) -> int:
        """Until every item is settled (or max_iterations); the run's exit code."""
        for left in self.landing.clean():
            self.run.bus.warn(f"removed what a killed run left: {left}")
        watchers = [w for w in (self.governor, self.rejuvenation) if w is not None]
        for watcher in watchers:
            watcher.start()
        try:
            return self._schedule()
        finally:
            for watcher in watchers:
                watcher.stop()
            self._halt()

    def _schedule(self) -> int:
        run, st = self.run, self.run.state
        limit = run.model.loop.max_iterations
        before = st.iteration - st.run_from  # this run's iterations before the schedule began
        warned = False
        with self.changed:
            while True:
                run.signals.raise_pending()
                if self.error is not None:
                    raise self.error
                text = checklist.read(run.checklist_path)
                if not warned and (message := checklist.near_miss_warning(text)):
                    run.bus.warn(message)  # once a run: lines like "-[ ] x" are never worked on
                warned = True
                run.counts.take(checklist.counts(text))
                todo = [i for i in checklist.parse(text) if i.mark == checklist.TODO]
                at_limit = bool(limit) and before + self.begun >= limit
                if not todo and not self.attempts:
                    self._summary(text)
                    return ExitCode.DONE
                if at_limit and not self.attempts:
                    self._summary(text, stopped=True)
                    return ExitCode.MAX_ITERATIONS
                if self._paused() or self._told() or self._rejuvenated():
                    continue
                started = False
                while not (at_limit or self._held()):
                    item = self._next(todo) if len(self.attempts) < self.admitted else None
                    if item is None:
                        break
                    self._start(item, todo)
                    started = True
                    at_limit = bool(limit) and before + self.begun >= limit
                if not started:
                    self.changed.wait(timeout=pause.POLL)  # woken by an attempt's end

    def _held(self) -> bool:
        """Nothing starts: a death's recovery, a usage limit, or a restart due (rejuvenation.py:
        the attempts in flight land first)."""
        rejuvenating = self.rejuvenation is not None and self.rejuvenation.due is not None
        return self.recovering or rejuvenating or self.hold.left() is not None

    def _rejuvenated(self) -> bool:
        """A restart due and no attempt in flight: the item boundary. Restart, then go on."""
        rejuvenation = self.rejuvenation
        if rejuvenation is None or rejuvenation.due is None or self.attempts:
            return False
        variables = self.work.facts(None).get("variables", {})
        self._unlocked(lambda: rejuvenation.restart(dict(variables)))
        self.run.counts.forget()  # its steps ran
        return True

    def _summary(self, text: str, stopped: bool = False) -> None:
        self._unlocked(lambda: self.summary(text, stopped))

    def _paused(self) -> bool:
        """`ralph-run pause`: start nothing more; with --now, kill the agent steps in flight;
        once none is in flight, hold the run (the pause and resume blocks)."""
        wanted = pause.read(self.pause.path)
        if self.attempts:
            if wanted is not None and wanted.get("now"):
                for attempt in self.attempts.values():
                    if attempt.agent_step is not None and not attempt.paused:
                        attempt.paused = True
                        self.pause.killed = self.pause.killed or attempt.agent_step
                        attempt.kill_step()
            self._unlocked(lambda: self.pause.seen(wanted))
            if wanted is not None:
                self.changed.wait(timeout=pause.POLL)
            return wanted is not None
        if wanted is None:
            return False
        self._unlocked(lambda: self.pause.hold(wanted, self._check_between))
        return True

    def _check_between(self, phase: str) -> None:
        self.work.ensure_service(None, phase)

    def _told(self) -> bool:
        """A usage limit's countdown, or its end (state saved)."""
        changed = False

        def tell() -> None:
            nonlocal changed
            changed = self.hold.tell(self.run.bus, self.run.state)
            if changed:
                self.run.save()

        self._unlocked(tell)
        return changed

    def _unlocked(self, call: Callable[[], None]) -> None:
        """What emits and saves runs outside the lock: a follower's or a save's wait must not
        hold the attempts that want it."""
        self.changed.release()
        try:
            call()
        finally:
            self.changed.acquire()

    def _next(self, todo: list[checklist.Item]) -> checklist.Item | None:
        """The first item not in flight whose turn it is: a waiting one only once every item
        before it is settled. While items are suspected of a death (loop/blame.py), one of
        them alone, nothing beside it."""
        suspects = self.run.blame.suspects
        if suspects:
            if self.attempts:
                return None
            found = next((item for item in todo if item.text in suspects), None)
            if found is not None:
                self.waiting.discard(found.text)
                return found
            suspects.clear()  # none of them is left to do (done or marked by hand)
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
        attempt = Attempt(
            run=self.run,
            check_service=self.work.ensure_service,
            worker=worker,
            alone=self.landing.alone,
            item=item,
            strikable=not any(other.index < item.index for other in todo),
            workdir=self.run.plan.workdir,
            checklist_path=self.run.checklist_path,
        )
        self.attempts[worker] = attempt
        self.begun += 1
        attempt.thread = threading.Thread(
            target=self._attempt, args=(attempt,), name=f"worker-{worker}", daemon=True
        )
        attempt.thread.start()

    # -- one attempt (its own thread) ----------------------------------------------------------
    def _attempt(self, attempt: Attempt) -> None:
        try:
            self.work.attempt(attempt)
            if attempt.iteration is not None and attempt.iteration.outcome == "deferred":
                with self.changed:
                    self.waiting.add(attempt.item.text)
        except BaseException as exc:  # GaveUp, a template's FatalError, a bug: the run ends
            with self.changed:
                if self.error is None:
                    self.error = exc
            if attempt.iteration is not None:
                attempt.iteration.cut_short(exc)
        finally:
            self.landing.release(attempt)
            with self.changed:
                self.attempts.pop(attempt.worker, None)
                self.changed.notify_all()
            if not attempt.alone:
                self.run.save()

    # -- a death (the service calls these itself: a follower of the events may be dropped) --
    def dying(self) -> Blamed | None:
        """Before the capture: start nothing until the recovery is over, kill the agent steps
        in flight (each item is retried, no strike), and count the death against the items
        whose prompts were in flight (loop/blame.py): what the death record says of them."""
        if self.rejuvenation is not None:
            self.rejuvenation.cancel()  # the recovery restarts it: its signs start over
        with self.changed:
            self.recovering = True
            for attempt in self.attempts.values():
                attempt.kill_step()
            in_flight = [a.item.text for a in self.attempts.values() if a.sent]
            return self.run.blame.death(in_flight)

    def signed(self, death: int, signature: str | None) -> None:
        """After the record: a signature that points at KV-cache pressure sheds a worker."""
        if self.governor is not None:
            self.governor.death_signed(death, signature)

    def _recovered(self) -> None:
        with self.changed:
            self.recovering = False
            self.changed.notify_all()

    def admit(self, workers: int) -> None:
        """The governor's decision: at most `workers` in flight from now (none is killed)."""
        with self.changed:
            self.admitted = workers
            self.changed.notify_all()
        self.run.save_status()

    def in_flight(self) -> int:
        return len(self.attempts)

    def items_in_flight(self) -> list[str]:
        return [attempt.item.text for attempt in self.attempts.values()]

    # -- the stop ------------------------------------------------------------------------------
    def _halt(self) -> None:
        """Every attempt killed and joined, its worktree and branch removed; nothing landed
        half (a landing is one fast-forward)."""
        with self.changed:
            attempts = list(self.attempts.values())
            for attempt in attempts:
                attempt.killed.set()
                if attempt.step_cancel is not None:
                    attempt.step_cancel.set()
        if attempts:
            self.run.stop.set()  # waits in the attempts (a recovery's, the settle's) end now
            execute.kill_all()
        deadline = time.monotonic() + JOIN_SECONDS
        for attempt in attempts:
            if attempt.thread is not None:
                attempt.thread.join(max(0.0, deadline - time.monotonic()))
        if attempts:
            execute.kill_all()
        if self.hold.until is not None:
            self.run.state.limited = None  # the run ends: no wait is under way
        try:
            self.landing.clean()
        except (worktrees.GitFailed, FatalError) as exc:
            self.run.bus.warn(f"worktrees not cleaned: {exc}")

    def statuses(self) -> list[Worker] | None:
        """status.json's `workers` (N > 1): each worker's item and phase. Without the lock (a
        copy of the dict): a save may come from a thread that holds the bus or the Service."""
        if self.landing.alone:
            return None
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


def metrics_url(run: RunContext, given: str | None) -> str:
    """Where `workers: auto` and `health.rejuvenate` look: `given` (their `metrics`), else the
    `progress` probe's."""
    if given:
        return run.plan.templar.render(given, run.plan.variables)
    for spec in run.health.probes:
        if spec.kind == "progress":
            return str(spec.params.metrics)
    raise FatalError("the server's /metrics is not known")  # check_auto or the loader said so first


def check_auto(plan: Plan, auto: bool) -> None:
    """At preflight (before the setup blocks run): `workers: auto` has a /metrics to read
    (`health.rejuvenate`'s is checked when the runbook loads: it does not hang on -w)."""
    progress = any(probe.kind == "progress" for probe in plan.runbook.probes)
    if auto and not plan.model.loop.governor.metrics and not progress:
        raise FatalError(NO_METRICS.format(what="workers: auto", where="loop.governor.metrics"))
