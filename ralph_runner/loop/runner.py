"""The Ralph loop: one checklist item per iteration, steps as tasks, no false strikes."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Literal

from ralph_runner import events
from ralph_runner.deaths import log as death_log
from ralph_runner.deaths import wiring
from ralph_runner.deaths.log import for_plan as death_log_for
from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import (
    AgentBrokenError,
    ExitCode,
    FatalError,
    GaveUp,
    Interrupted,
    LimitedError,
)
from ralph_runner.liveness.health import for_plan as health_for
from ralph_runner.liveness.service import Service
from ralph_runner.loop import housekeeping, lifecycle, pause, proxy, scheduler, state
from ralph_runner.loop.blame import Blame
from ralph_runner.loop.context import ChecklistCounts, RunContext
from ralph_runner.output.bus import EventBus
from ralph_runner.process import execute, orphans
from ralph_runner.runbook import preflight
from ralph_runner.runbook.plan import Plan
from ralph_runner.workspace import checklist, git
from ralph_runner.workspace.state_files import STATE_DIR
from ralph_runner.workspace.status_file import HangBound, Status

if TYPE_CHECKING:
    from ralph_runner.liveness.health import Health


class Runner:
    """Runs one plan's loop until the checklist is done, max_iterations, give-up or a signal."""

    def __init__(
        self, plan: Plan, bus: EventBus, workers: int | Literal["auto"] | None = None
    ) -> None:
        self.plan, self.bus = plan, bus
        self.model = plan.model
        # loop.workers, or --workers: more than 1 runs items at once in worktrees; auto: up to
        # loop.max_workers, as many as the server has headroom for (loop/governor.py)
        wanted = workers or plan.model.loop.workers
        self.auto = wanted == "auto"
        self.workers = plan.model.loop.max_workers if wanted == "auto" else wanted
        self._saving = threading.RLock()  # workers' threads save too
        self.store = state.Store(plan.workdir, bus.redactor, bus.warn)
        self.counts = ChecklistCounts(plan.path(("checklist", "path"), self.model.checklist.path))
        self.stop = threading.Event()
        self.state = state.State()
        self.blame = Blame(self.model.checklist.set_aside_after, {}, [])
        self.started = time.monotonic()
        self.redactor = Redactor(plan.secret_values())
        self.ignore = _housekeeping_patterns(plan)
        self.in_repo = False
        self.signals = execute.InterruptsRaise()
        self._bound_shown: int | None = None  # the hang bound's whole seconds in status.json
        self.health: Health | None = None
        self.service: Service | None = None
        # made once the service exists (in _run): what status.json reads of them
        self.pause: pause.Pause | None = None  # `ralph-run pause`
        self.lifecycle: lifecycle.Lifecycle | None = None  # the runbook's `setup:`, `teardown:`
        self.scheduler: scheduler.Scheduler | None = None

    # -- the run --------------------------------------------------------------
    def run(self) -> int:
        """The loop's exit code; an interrupt is reported (state saved) and raised on to the CLI."""
        try:
            return self._run()
        except Interrupted as exc:
            self.bus.emit(events.Interrupted(signal=str(exc), exit_code=exc.exit_code))
            raise

    def _run(self) -> int:
        self._preflight()
        with (
            self.store.lock(),
            self.signals,
            orphans.recorded(self.store.dir),
            execute.tree_guard(),
            proxy.running(self.plan, self.bus.warn) as agent_proxy,
            wiring.attached(
                self.plan, self.bus, self.store.dir, agent_proxy.meter if agent_proxy else None
            ) as session,
        ):
            self.state = self._resume()
            self.blame = Blame(
                self.model.checklist.set_aside_after, self.state.item_deaths, self.state.suspects
            )
            death_log = death_log_for(self.plan)
            git.exclude_from_git(
                self.plan.workdir,
                [self.store.dir, death_log.log_path, death_log.records_path],
                self.ignore,
            )
            health = self.health = health_for(
                self.plan, agent_proxy.awaiting if agent_proxy else None
            )
            service = self.service = Service(
                self.plan, health, death_log, self.state, self.save, self.stop, self.bus.emit,
                session,
            )  # fmt: skip
            run = RunContext(
                plan=self.plan,
                bus=self.bus,
                state=self.state,
                store=self.store,
                stop=self.stop,
                signals=self.signals,
                redactor=self.redactor,
                counts=self.counts,
                in_repo=self.in_repo,
                housekeeping=housekeeping.filter_for(self.plan.workdir, self.ignore),
                proxy=agent_proxy,
                health=health,
                service=service,
                save=self.save,
                save_status=lambda: self.save(status_only=True),
                blame=self.blame,
            )
            self.pause = pause.Pause(run)
            self.bus.follow(self.pause)  # the step's start, for status.json
            self.lifecycle = lifecycle.Lifecycle(run)
            # What imports and the runbook's load made lives as long as the run: the collector
            # need not walk it again and again (its oldest generation took ~0.6 ms an iteration).
            gc.freeze()
            try:
                self.lifecycle.setup()  # before the first health check: acquire, then start
                self.scheduler = scheduler.Scheduler(
                    run, self.pause, self.workers, self.auto, self._show_bound, self.summary
                )
                service.control = self.scheduler  # a death stops the attempts in flight
                code = self.scheduler.run_all()
                state.move(self.state, "finished" if code == ExitCode.DONE else "stopped")
                return code
            except GaveUp:
                state.move(self.state, "gave-up")
                raise
            except AgentBrokenError:
                state.move(self.state, "agent-broken")
                raise
            except LimitedError:
                state.move(self.state, "limited")
                raise
            except FatalError as exc:  # e.g. a template error in a step: fix the runbook, run again
                state.move(self.state, "failed")
                self.state.error = str(exc)  # status.json says why (`ralph-run status`)
                raise
            except Interrupted:
                self.stop.set()
                execute.kill_all()
                state.move(self.state, "interrupted")
                raise
            except Exception:  # a bug in ralph-run: said as such, and resumed by the next run
                state.move(self.state, "crashed")
                raise
            finally:
                self.lifecycle.teardown()  # once, whatever the end (a kill -9: the next run)
                health.close()
                self.state.phase = None
                self.save()

    def _preflight(self) -> None:
        """What would only fail at the first iteration fails now, at its line in the runbook."""
        # --check finds the same (commands/check.py); a planted link at the death log would
        # take the next death's text
        found = preflight.problems(self.plan) + death_log.unsafe(self.plan)
        if found:
            raise FatalError(found)
        self.in_repo = git.is_repo(self.plan.workdir)
        if self.in_repo:  # before .ralph/ is made or written: a tracked one is the repository's
            ours = [self.store.dir]
            if self.workers > 1:  # the worktrees live under the top's .ralph/
                ours.append(git.top(self.plan.workdir) / STATE_DIR)
            git.refuse_tracked(self.plan.workdir, ours)
        if self.workers > 1 and (not self.in_repo or git.head(self.plan.workdir) is None):
            raise FatalError(
                f"workers: {'auto' if self.auto else self.workers} needs the workdir in a git "
                "repository with a commit (each attempt works in its own git worktree)"
            )
        # now, not after the setup blocks ran
        scheduler.check_auto(self.plan, self.auto and self.workers > 1)

    def _resume(self) -> state.State:
        loaded = self.store.load()
        if loaded.status in state.STARTS_OVER:
            # Iteration numbers go on across runs in a workdir, so a death's "iter 9" and top's
            # list name one iteration each; max_iterations counts this run's from here.
            loaded.run_from = loaded.iteration
            loaded.started = time.time()
        else:
            resumed = events.Resume(
                iteration=loaded.iteration, deaths=loaded.deaths, item=loaded.current_item
            )
            self.bus.emit(resumed)
        loaded.pid = os.getpid()
        state.move(loaded, "running")
        loaded.agent_broken = None  # it explained the last stop; this run starts over
        loaded.limited = None
        loaded.error = None
        # the start this run makes, if any: an old run's failed start is no news after it
        loaded.last_start = None
        return loaded

    def save(self, status_only: bool = False) -> None:
        """Persist state and status; a full disk is reported, and the loop goes on. Each
        warning names the file it is about (the error carries its path): the state, the
        status, or the checklist whose counts the status could not take."""
        with self._saving:
            if not status_only:
                try:
                    self.store.save(self.state)
                except FatalError as exc:
                    self.bus.warn(f"state not saved: {exc}")
            try:
                self.store.write_status(self._status())
            except FatalError as exc:
                self.bus.warn(f"status not saved: {exc}")

    def _status(self) -> Status:
        st = self.state
        counts: checklist.Counts | None
        try:
            counts = self.counts.get()
        except FatalError as exc:  # the run stops on it (or has): the status still says so
            counts = self.counts.last
            if st.status == "running":  # an ended run's status has the error already
                message = f"status.json keeps the last checklist counts: {exc}"
                self.bus.warn(message)
        status: Status = {
            "status": st.status,
            "pid": st.pid,
            "running": st.status == "running",
            "iteration": st.iteration,
            "item": st.current_item,
            "phase": st.phase,
            "deaths": st.deaths,
            "last_death": st.last_death,
            "last_start": st.last_start,
            "agent_broken": st.agent_broken,
            "limited_until": st.limited["until"] if st.limited else None,
            "limited": st.limited,
            "failure": st.error,  # why the run failed; "error" is a reader's (no status read)
            **(self.pause.fields() if self.pause else pause.NOT_PAUSED),
            "hang_bound": self._hang_bound(),
            "updated": time.time(),
            "workdir": str(self.plan.workdir),
        }
        if self.scheduler is not None and (workers := self.scheduler.statuses()) is not None:
            status["workers"] = workers
            if self.scheduler.governor is not None:
                status["governor"] = self.scheduler.governor.fields()
        if self.scheduler is not None and self.scheduler.rejuvenation is not None:
            status["rejuvenation"] = self.scheduler.rejuvenation.fields()
        if self.lifecycle is not None and (blocks := self.lifecycle.fields()) is not None:
            status["lifecycle"] = blocks
        if st.set_aside:
            status["set_aside"] = list(st.set_aside)
        if counts is not None:  # none: the checklist was never read
            status["done"], status["todo"], status["skipped"] = (
                counts.done,
                counts.todo,
                counts.skipped,
            )
            status["chars"], status["lines"] = counts.chars, counts.lines
        return status

    def _show_bound(self) -> None:
        """After a watch round: the status follows the hang bound (whole seconds) mid-step."""
        bound = self._hang_bound()
        shown = None if bound is None else round(bound["seconds"])
        if shown != self._bound_shown:
            self._bound_shown = shown
            self.save(status_only=True)

    def _hang_bound(self) -> HangBound | None:
        """The progress probes' hang bound now (docs: hangs), once a check computed one."""
        found = self.health.hang_bound() if self.health is not None else None
        return None if found is None else {"seconds": round(found[0], 1), "why": found[1]}

    def summary(self, text: str, stopped: bool) -> None:
        counts = checklist.counts(text)
        signatures = Counter(self.service.signatures if self.service else ()).most_common()
        self.bus.emit(
            events.Summary(
                stopped_at_max=stopped,
                iterations=self.state.iteration - self.state.run_from,  # this run's
                done=counts.done,
                todo=counts.todo,
                skipped=counts.skipped,
                deaths=self.state.deaths,
                signatures=dict(signatures),
                seconds=round(time.monotonic() - self.started, 1),
                set_aside=self.blame.this_run,
                malformed=len(checklist.near_misses(text)),
            )
        )


def _housekeeping_patterns(plan: Plan) -> list[str]:
    """The agents' own files: the built-in list and every verify step's `ignore:`."""
    patterns = list(housekeeping.DEFAULT_IGNORE)
    for spec in plan.runbook.loop_steps:
        if spec.kind == "verify" and spec.params is not None:
            patterns.extend(p for p in spec.params.ignore if p not in patterns)
    return patterns
