"""The Ralph loop: one checklist item per iteration, steps as tasks, no false strikes."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections import Counter
from typing import Literal, cast

from ralph_runner import events
from ralph_runner.actions import KINDS, UNWATCHED, TaskResult
from ralph_runner.deaths import log as death_log
from ralph_runner.deaths import wiring
from ralph_runner.deaths.log import for_plan as death_log_for
from ralph_runner.deaths.record import Facts
from ralph_runner.durable.json_value import JSONObject
from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import AgentBroken, ExitCode, FatalError, GaveUp, Interrupted, Limited
from ralph_runner.liveness.health import for_plan as health_for
from ralph_runner.liveness.service import Service
from ralph_runner.liveness.step_watch import Watch
from ralph_runner.loop import failures, housekeeping, idle, lifecycle, pause, proxy, state
from ralph_runner.loop import workers as workers_pool
from ralph_runner.loop.iteration import Iteration, step_entry
from ralph_runner.output import EventBus, plural
from ralph_runner.process import execute, orphans, output_text
from ralph_runner.runbook import preflight, tasks
from ralph_runner.runbook.loader import TaskSpec
from ralph_runner.runbook.plan import Plan
from ralph_runner.workspace import checklist, git
from ralph_runner.workspace.state_files import STATE_DIR
from ralph_runner.workspace.status_file import HangBound, Status

SETTLE = 1.0  # seconds a failed attempt waits before its after-failure health check
# What each action kind declares of itself (actions/__init__.py): no kind is named here.
QUICK = frozenset(key for key, kind in KINDS.items() if getattr(kind, "QUICK", False))


class Runner:
    """Runs one plan's loop until the checklist is done, max_iterations, give-up or a signal."""

    def __init__(
        self, plan: Plan, bus: EventBus, workers: int | Literal["auto"] | None = None
    ) -> None:
        self.plan, self.bus = plan, bus
        self.model = plan.model
        # loop.workers, or --workers: more than 1 runs items at once (loop/workers.py); auto:
        # up to loop.max_workers, as many as the server has headroom for (loop/governor.py)
        wanted = workers or plan.model.loop.workers
        self.auto = wanted == "auto"
        self.workers = plan.model.loop.max_workers if wanted == "auto" else wanted
        self.pool: workers_pool.Pool | None = None
        self._saving = threading.RLock()  # workers' threads save too
        self.store = state.Store(plan.workdir, bus.redactor, bus.warn)
        self.checklist_path = plan.path(("checklist", "path"), self.model.checklist.path)
        self.stop = threading.Event()
        self.state = state.State()
        self.started = time.monotonic()
        self.iteration: Iteration | None = None  # the iteration in hand, or the last one
        self.redactor = Redactor(plan.secret_values())
        self.ignore = _housekeeping_patterns(plan)
        self.in_repo = False
        self.known: git.Snapshot | None = None  # the work tree after the last iteration, if known
        self._output_lines = output_text.Lines()  # -v: the step's output as it arrives
        self.signals = execute.InterruptsRaise()
        # The checklist's counts for status.json and death records, read again only after
        # something that can change the file ran (a process step, a recovery, a skip).
        self._counts: checklist.Counts | None = None
        self._last_counts: checklist.Counts | None = None  # the last read, if the file goes bad
        self.limited_since: float | None = None  # the first of the limited attempts in a row
        self.proxy: proxy.Proxy | None = None  # the agent's receipts proxy (loop.proxy), if on
        self._bound_shown: int | None = None  # the hang bound's whole seconds in status.json
        self.pause = pause.Pause(self)  # `ralph-run pause`: held at the iteration boundary
        bus.follow(self.pause)
        self.lifecycle = lifecycle.Lifecycle(self)  # the runbook's `setup:` and `teardown:`

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
            proxy.running(self.plan, self.bus.warn) as self.proxy,
            wiring.attached(
                self.plan, self.bus, self.store.dir, self.proxy.meter if self.proxy else None
            ) as session,
        ):
            self.state = self._resume()
            death_log = death_log_for(self.plan)
            git.exclude_from_git(
                self.plan.workdir,
                [self.store.dir, death_log.log_path, death_log.records_path],
                self.ignore,
            )
            self.housekeeping = housekeeping.filter_for(self.plan.workdir, self.ignore)
            health = health_for(self.plan, self.proxy.awaiting if self.proxy else None)
            self.service = Service(
                self.plan,
                health,
                death_log,
                self.state,
                self.save,
                self.stop,
                self.bus.emit,
                session,
            )
            self.health = health
            # What imports and the runbook's load made lives as long as the run: the collector
            # need not walk it again and again (its oldest generation took ~0.6 ms an iteration).
            gc.freeze()
            try:
                self.lifecycle.setup()  # before the first health check: acquire, then start
                code = self._loop()
                state.move(self.state, "finished" if code == ExitCode.DONE else "stopped")
                return code
            except GaveUp:
                state.move(self.state, "gave-up")
                raise
            except AgentBroken:
                state.move(self.state, "agent-broken")
                raise
            except Limited:
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
        if self.auto and self.workers > 1:
            workers_pool.check_auto(self.plan)  # now, not after the setup blocks ran

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
        return loaded

    def _loop(self) -> int:
        if self.workers > 1:
            self.pool = workers_pool.Pool(self, self.workers, self.auto)
            return self.pool.run()
        limit = self.model.loop.max_iterations
        warned = False
        while True:
            self.signals.raise_pending()
            text = checklist.read(self.checklist_path)
            if not warned and (message := checklist.near_miss_warning(text)):
                self.bus.warn(message)  # once a run: lines like "-[ ] x" are never worked on
            warned = True
            self._counts = checklist.counts(text)
            item = checklist.next_todo(text)
            if item is None:
                self.summary(text)
                return ExitCode.DONE
            if limit and self.state.iteration - self.state.run_from >= limit:
                self.summary(text, stopped=True)
                return ExitCode.MAX_ITERATIONS
            self.pause.iterate(item)  # self.run_iteration(item), or a wait: `ralph-run pause`

    def run_iteration(self, item: checklist.Item) -> None:
        st = self.state
        st.iteration += 1
        st.current_item = item.text
        st.phase = None  # not the last iteration's verify: QUICK steps write no status
        self.save()
        start, self.known = self.known or self.snapshot(), None
        it = self.iteration = Iteration(self, item, start)
        variables = it.render(self.checklist_counts(), proxy.variables(self.plan, self.proxy))
        self.bus.emit(it.started())
        try:
            group = tasks.TaskGroup(
                self.plan,
                connection=self.plan.controller(),
                cwd=self.plan.workdir,
                run=self,
                on_output=self._show_output if self.bus.verbose else None,
                idle=idle.watches(self.plan, self.health, self.store.dir),
            )
            restarts_before = self.health.restarts()[0]
            for spec in self.plan.runbook.loop_steps:
                if it.failed_step and spec.kind != "ensure_alive":
                    continue  # after a failure only health checks run: a death must still be seen
                it.took(spec, self._step(spec, group, variables))
            if it.failed_step and not it.died() and self.plan.runbook.probes:
                # A dying server may still answer for a moment after failing the agent's call
                # (vLLM's /v1/models answers 200 for ~0.3 s after its engine died, then the API
                # server exits): look again, at least SETTLE s later, before blaming the item.
                self.stop.wait(max(self.model.health.interval, SETTLE))
                self.ensure_service("after-failure")
                self._account_for(it.deaths_before, restarts_before)
            it.settle()
            self.known = it.next_start()
        except BaseException as exc:  # the run ends inside the iteration: it says how
            it.cut_short(exc)
            raise

    def _account_for(self, deaths_before: int, restarts_before: int) -> None:
        """A failed attempt with a healthy service now is the agent's only if the service was
        the same server and made progress (or idled) through it: a restart by someone else is
        a death of its own; work that waits with no progress is watched until the probes'
        stall window decides (a step that timed out before the hang bound ran out)."""
        st = self.state
        if st.deaths != deaths_before:
            return
        restarts, evidence = self.health.restarts()
        if restarts > restarts_before:
            self.service.restarted("after-failure", evidence or "a new server", self._facts())
            return
        limit = time.monotonic() + self.health.stall_window() + 2 * self.model.health.watch
        while st.deaths == deaths_before and self.health.waiting_since() is not None:
            if time.monotonic() > limit or self.stop.wait(self.model.health.interval):
                return
            self.ensure_service("after-failure")

    def _step(
        self, spec: TaskSpec, group: tasks.TaskGroup, variables: dict[str, object]
    ) -> TaskResult:
        self.state.phase = spec.name
        if spec.kind not in QUICK:
            self.save(status_only=True)  # for people watching; the state has not moved
        self.bus.emit(events.Step(step=spec.name, action=spec.kind))
        started = time.monotonic()
        watch_every = self.model.health.watch if self.plan.runbook.probes else 0
        if spec.kind in UNWATCHED:
            watch_every = 0
        with (
            Watch(self.health, watch_every, self.state.iteration, self._show_bound) as watch,
            # an agent's work leaves nothing running (a recovery's server must outlive its step)
            execute.swept() if spec.kind not in UNWATCHED else contextlib.nullcontext() as swept,
        ):
            result = tasks.run(spec, group, variables, watch.cancel)
        if swept is not None and swept.killed:
            left = plural(len(swept.killed), "process")
            self.bus.warn(f"{spec.name} left {left} running: killed {', '.join(swept.killed)}")
        if spec.kind not in UNWATCHED:
            self._counts = None  # the agent may have ticked its item
        self.signals.raise_pending()  # the step was killed by a signal: no strike for it
        self._flush_output()
        ok = result.ok
        self.bus.emit(
            events.StepDone(
                step=spec.name,
                ok=ok,
                exit_code=result.exit_code,
                timed_out=result.timed_out,
                killed=result.cancelled,
                stalled=bool(result.stalled),
                status="ok"
                if ok
                else failures.status_text(
                    result.exit_code,
                    result.timed_out,
                    result.cancelled,
                    result.output,
                    result.stalled,
                ),
                seconds=round(time.monotonic() - started, 3),
            )
        )
        if watch.rounds is not None:
            self.bus.emit(events.Watch(step=spec.name, killed=True))
            killed = step_entry(spec, result, self.redactor)
            self.service.died("during-step", watch.rounds, {**self._facts(), "step": killed})
        return result

    def _show_output(self, text: str) -> None:
        """`-v`: the step's output, a line at a time (it arrives in arbitrary chunks), without
        the escape codes that would garble a log file or move a terminal's cursor."""
        for line in self._output_lines.feed(text):  # a line over 64 KiB comes in cut pieces
            self.bus.emit(events.Output(step=self.state.phase, text=line))

    def _flush_output(self) -> None:
        if (last := self._output_lines.end()) is not None:
            self.bus.emit(events.Output(step=self.state.phase, text=last))

    # -- what the runbook's actions call ---------------------------------------
    def ensure_alive(self, phase: str, context: dict[str, object]) -> TaskResult:
        started = time.monotonic()
        self.ensure_service(phase, context)
        return TaskResult(ok=True, seconds=time.monotonic() - started)

    def ensure_service(self, phase: str, context: dict[str, object] | None = None) -> None:
        self.state.phase = phase
        facts = self._facts()
        if context:  # an ensure_alive step's rendered YAML: JSON values
            facts["context"] = cast("JSONObject", context)
        deaths = self.state.deaths
        self.service.ensure_alive(phase, facts, self.state.iteration)
        if self.state.deaths != deaths:
            self._counts = None  # recovery steps ran

    @property
    def item_in_hand(self) -> str | None:
        """The checklist item this iteration works on, for verify."""
        return self.state.current_item

    @property
    def before(self) -> git.Snapshot | None:
        """The work tree when the iteration in hand began, for verify."""
        return self.iteration.before if self.iteration else None

    def look_at_tree(self) -> git.Snapshot | None:
        """The work tree now, for verify; kept as what the next iteration starts from."""
        return self.iteration.look_at_tree() if self.iteration else self.snapshot()

    # -- helpers ---------------------------------------------------------------
    def snapshot(self) -> git.Snapshot | None:
        """HEAD and the changed paths, agent housekeeping left out; None outside a repository."""
        if not self.in_repo:
            return None
        return git.snapshot(self.plan.workdir).without(self.housekeeping)

    def forget_counts(self) -> None:
        """Something that can change the checklist ran: read its counts again when asked."""
        self._counts = None

    def checklist_counts(self) -> checklist.Counts:
        if self._counts is None:
            self._counts = checklist.counts(checklist.read(self.checklist_path))
        return self._counts

    def _facts(self) -> Facts:
        """What a death record knows of the loop: the last iteration's item, variables and
        failed step (between iterations too: a death at `resume` is in the last one's wake)."""
        it = self.iteration
        variables = it.variables if it else {}
        failed = it.failed_step if it else None
        counts = self.checklist_counts()
        return {
            "iteration": self.state.iteration,
            "item": it.entry if it else None,
            **(Facts(step=failed) if failed else Facts()),
            "prompt_size": len(it.prompt) if it else None,
            "prompt_bytes": it.prompt_bytes if it else None,
            "checklist": counts.as_dict(),
            "variables": {**variables, "checklist": counts.as_dict()},
        }

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
            counts = self._last_counts = self.checklist_counts()
        except FatalError as exc:  # the run stops on it (or has): the status still says so
            counts = self._last_counts
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
            **self.pause.fields(),  # paused, pause, step_started, attempts
            "hang_bound": self._hang_bound(),
            "updated": time.time(),
            "workdir": str(self.plan.workdir),
        }
        if self.pool is not None:
            status["workers"] = self.pool.statuses()
            if self.pool.governor is not None:
                status["governor"] = self.pool.governor.fields()
        if (blocks := self.lifecycle.fields()) is not None:
            status["lifecycle"] = blocks
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
        health = getattr(self, "health", None)  # the first status is written before it exists
        found = health.hang_bound() if health is not None else None
        return None if found is None else {"seconds": round(found[0], 1), "why": found[1]}

    def summary(self, text: str, stopped: bool = False) -> None:
        counts = checklist.counts(text)
        self.bus.emit(
            events.Summary(
                stopped_at_max=stopped,
                iterations=self.state.iteration - self.state.run_from,  # this run's
                done=counts.done,
                todo=counts.todo,
                skipped=counts.skipped,
                deaths=self.state.deaths,
                signatures=dict(Counter(self.service.signatures).most_common()),
                seconds=round(time.monotonic() - self.started, 1),
            )
        )


def _housekeeping_patterns(plan: Plan) -> list[str]:
    """The agents' own files: the built-in list and every verify step's `ignore:`."""
    patterns = list(housekeeping.DEFAULT_IGNORE)
    for spec in plan.runbook.loop_steps:
        if spec.kind == "verify" and spec.params is not None:
            patterns.extend(p for p in spec.params.ignore if p not in patterns)
    return patterns
