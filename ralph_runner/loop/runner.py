"""The Ralph loop: one checklist item per iteration, steps as tasks, no false strikes."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import Counter
from typing import Any

from ralph_runner.actions import KINDS, UNWATCHED, TaskResult
from ralph_runner.deaths import wiring
from ralph_runner.deaths.log import for_plan as death_log_for
from ralph_runner.deaths.record import Facts, StepEntry
from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import AgentBroken, ExitCode, FatalError, GaveUp, Interrupted, Limited
from ralph_runner.liveness.health import for_plan as health_for
from ralph_runner.liveness.service import Service
from ralph_runner.liveness.step_watch import Watch
from ralph_runner.loop import failures, housekeeping, idle, limits, pause, proxy, state
from ralph_runner.loop.failures import Failure
from ralph_runner.output import Output
from ralph_runner.process import execute, orphans, output_text
from ralph_runner.runbook import preflight, tasks
from ralph_runner.runbook.loader import TaskSpec
from ralph_runner.runbook.plan import Plan
from ralph_runner.workspace import checklist, git

SETTLE = 1.0  # seconds a failed attempt waits before its after-failure health check
# What each action kind declares of itself (actions/__init__.py): no kind is named here.
QUICK = frozenset(key for key, kind in KINDS.items() if getattr(kind, "QUICK", False))


class Runner:
    """Runs one plan's loop until the checklist is done, max_iterations, give-up or a signal."""

    def __init__(self, plan: Plan, output: Output) -> None:
        self.plan, self.output = plan, output
        self.model = plan.model
        self.store = state.Store(plan.workdir, output.redactor, self._warn)
        self.checklist_path = plan.path(("checklist", "path"), self.model.checklist.path)
        self.stop = threading.Event()
        self.state = state.State()
        self.started = time.monotonic()
        self.iteration_vars: dict[str, Any] = {}
        self.redactor = Redactor(plan.secret_values())
        self.ignore = _housekeeping_patterns(plan)
        self.in_repo = False
        self.before: git.Snapshot | None = None  # the work tree when the iteration began
        self.after: git.Snapshot | None = None  # ... when verify looked at it
        self.known: git.Snapshot | None = None  # ... at the end of the last iteration, if known
        self.failed_step: StepEntry | None = None  # the iteration's failed or killed step
        self._partial_line = ""
        self.signals = execute.InterruptsRaise()
        # The checklist's counts for status.json and death records, read again only after
        # something that can change the file ran (a process step, a recovery, a skip).
        self._counts: checklist.Counts | None = None
        self._last_counts: checklist.Counts | None = None  # the last read, if the file goes bad
        self._outputs: list[str] = []  # the iteration's process steps' output, for limits.py
        self._limited_since: float | None = None  # the first of the limited attempts in a row
        self.proxy: proxy.Proxy | None = None  # the agent's receipts proxy (loop.proxy), if on
        self._bound_shown: int | None = None  # the hang bound's whole seconds in status.json

    # -- the run --------------------------------------------------------------
    def run(self) -> int:
        """The loop's exit code; an interrupt is reported (state saved) and raised on to the CLI."""
        try:
            return self._run()
        except Interrupted as exc:
            self.output.event("interrupted", signal=str(exc), exit_code=exc.exit_code)
            raise

    def _run(self) -> int:
        self._preflight()
        with (
            self.store.lock(),
            self.signals,
            orphans.recorded(self.store.dir),
            execute.tree_guard(),
            wiring.attached(self.plan, self.output, self.store.dir) as session,
            proxy.running(self.plan, self._warn, session.history) as self.proxy,
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
                self.plan, health, death_log, self.state, self.save, self.stop, self.output.event
            )
            self.health = health
            # What imports and the runbook's load made lives as long as the run: the collector
            # need not walk it again and again (its oldest generation took ~0.6 ms an iteration).
            gc.freeze()
            try:
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
                health.close()
                self.state.phase = None
                self.save()

    def _preflight(self) -> None:
        """What would only fail at the first iteration fails now, at its line in the runbook."""
        found = preflight.problems(self.plan)  # --check finds the same (commands/check.py)
        if found:
            raise FatalError(found)
        self.in_repo = git.is_repo(self.plan.workdir)

    def _resume(self) -> state.State:
        loaded = self.store.load()
        if loaded.status in state.STARTS_OVER:
            # Iteration numbers go on across runs in a workdir, so a death's "iter 9" and top's
            # list name one iteration each; max_iterations counts this run's from here.
            loaded.run_from = loaded.iteration
            loaded.started = time.time()
        else:
            self.output.event(
                "resume", iteration=loaded.iteration, deaths=loaded.deaths, item=loaded.current_item
            )
        loaded.pid = os.getpid()
        state.move(loaded, "running")
        loaded.agent_broken = None  # it explained the last stop; this run starts over
        loaded.limited = None
        loaded.error = None
        return loaded

    def _loop(self) -> int:
        limit = self.model.loop.max_iterations
        warned = False
        while True:
            self.signals.raise_pending()
            text = checklist.read(self.checklist_path)
            if not warned and (message := checklist.near_miss_warning(text)):
                self._warn(message)  # once a run: lines like "-[ ] x" are never worked on
            warned = True
            self._counts = checklist.counts(text)
            item = checklist.next_todo(text)
            if item is None:
                self._summary(text)
                return ExitCode.DONE
            if limit and self.state.iteration - self.state.run_from >= limit:
                self._summary(text, stopped=True)
                return ExitCode.MAX_ITERATIONS
            pause.iterate(self, item)  # self.run_iteration(item), or a wait: `ralph-run pause`

    def run_iteration(self, item: checklist.Item) -> None:
        st = self.state
        st.iteration += 1
        st.current_item = item.text
        st.phase = None  # not the last iteration's verify: QUICK steps write no status
        self.save()
        deaths_before = st.deaths
        self.failed_step, self.after, self._outputs = None, None, []
        self.before, self.known = self.known or self._snapshot(), None
        variables = self._variables(item)
        self.output.event(
            "iteration",
            iteration=st.iteration,
            item=item.text,
            attempts=variables["item"]["attempts"],
            done=variables["checklist"]["done"],
            todo=variables["checklist"]["todo"],
            skipped=variables["checklist"]["skipped"],
            deaths=st.deaths,
            prompt_size=variables["prompt_size"],
            prompt_bytes=variables["prompt_bytes"],
        )
        group = tasks.TaskGroup(
            self.plan,
            connection=self.plan.controller(),
            cwd=self.plan.workdir,
            run=self,
            on_output=self._show_output if self.output.verbose else None,
            idle=idle.watches(self.plan, self.health, self.store.dir),
        )
        failed: StepEntry | None = None
        agent_seconds, after_verify = 0.0, False
        restarts_before = self.health.restarts()[0]
        for spec in self.plan.runbook.loop_steps:
            if failed and spec.kind != "ensure_alive":
                continue  # after a failure only health checks run: a death must still be seen
            result = self._step(spec, group, variables)
            if spec.kind not in UNWATCHED:
                agent_seconds += result.seconds
                self._outputs.append(result.output)
            ran_after = self.after is not None and spec.kind not in ("verify", "ensure_alive")
            after_verify = after_verify or ran_after
            if not result.ok and not spec.task.ignore_errors and not failed:
                failed = self._step_record(spec, result)
                self.failed_step = failed
        if failed and st.deaths == deaths_before and self.plan.runbook.probes:
            # A dying server may still answer for a moment after failing the agent's call
            # (vLLM's /v1/models answers 200 for ~0.3 s after its engine died, then the API
            # server exits): look again, at least SETTLE s later, before blaming the item.
            self.stop.wait(max(self.model.health.interval, SETTLE))
            self.ensure_service("after-failure")
            self._account_for(deaths_before, restarts_before)
        died = st.deaths > deaths_before
        # What verify saw is the next iteration's start, unless something ran after it.
        self.known = None if died or after_verify else self.after
        self._settle(item, failed, died, agent_seconds)

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

    def _step_record(self, spec: TaskSpec, result: TaskResult) -> StepEntry:
        """A failed or killed step as reports show it: how it ended and its last words."""
        status = failures.status_text(
            result.exit_code, result.timed_out, result.cancelled, result.output, result.stalled
        )
        from_process = spec.kind not in UNWATCHED
        tail = failures.output_tail(result.output, self.redactor) if from_process else ""
        return {
            "name": spec.name,
            "status": status,
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "killed": result.cancelled,
            **(StepEntry(stalled=True) if result.stalled else StepEntry()),
            "output_tail": tail,
            "reason": failures.reason(spec.name, status, tail, from_process),
            "from_process": from_process,
        }

    def _step(self, spec: TaskSpec, group: tasks.TaskGroup, variables: dict) -> TaskResult:
        self.state.phase = spec.name
        if spec.kind not in QUICK:
            self.save(status_only=True)  # for people watching; the state has not moved
        self.output.event("step", step=spec.name, action=spec.kind)
        started = time.monotonic()
        watch_every = self.model.health.watch if self.plan.runbook.probes else 0
        if spec.kind in UNWATCHED:
            watch_every = 0
        with Watch(self.health, watch_every, self.state.iteration, self._show_bound) as watch:
            result = tasks.run(spec, group, variables, watch.cancel)
        if spec.kind not in UNWATCHED:
            self._counts = None  # the agent may have ticked its item
        self.signals.raise_pending()  # the step was killed by a signal: no strike for it
        self._flush_output()
        ok = result.ok
        self.output.event(
            "step-done",
            step=spec.name,
            ok=ok,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            killed=result.cancelled,
            **({"stalled": True} if result.stalled else {}),
            status="ok"
            if ok
            else failures.status_text(
                result.exit_code, result.timed_out, result.cancelled, result.output, result.stalled
            ),
            seconds=round(time.monotonic() - started, 3),
        )
        if watch.rounds is not None:
            self.output.event("watch", step=spec.name, killed=True)
            killed = self._step_record(spec, result)
            self.service.died("during-step", watch.rounds, {**self._facts(), "step": killed})
        return result

    def _settle(
        self,
        item: checklist.Item,
        failed: StepEntry | None,
        died: bool,
        agent_seconds: float,
    ) -> None:
        st = self.state
        if failed is None:
            self._limited_since = None
            st.strikes.pop(item.text, None)
            st.last_failure, st.streak_skipped = None, []
            self.output.event("done", item=item.text)
        elif died:
            self.output.event("retry", item=item.text, reason=failed["reason"])
        elif self._waited_out(item):
            pass  # a usage limit: no strike, no broken agent; the item comes again
        else:
            failure = self._failure(item, failed, agent_seconds)
            previous = Failure.from_dict(st.last_failure)
            if previous is not None and failure.same_as(previous):
                if previous.item != item.text:
                    self._agent_broken(previous, failure)
            else:
                st.streak_skipped = []
            st.last_failure = failure.as_dict()
            strikes = st.strikes.get(item.text, 0) + 1
            st.strikes[item.text] = strikes
            self.output.event(
                "strike",
                item=item.text,
                strikes=strikes,
                of=self.model.checklist.strikes,
                reason=failure.reason,
                output_tail=failure.output_tail,
            )
            if strikes >= self.model.checklist.strikes:
                self._skip(item, strikes)
                st.streak_skipped.append(item.text)
        st.current_item = None
        self.save()

    def _waited_out(self, item: checklist.Item) -> bool:
        """A failed attempt whose agent said "usage limit" (limits.py) is no strike and no
        failure for the broken-agent rule: wait for the reset (plus the margin) and retry the
        item, or stop (Limited, limits.exit_code) when it is further than limits.max_wait."""
        config = self.model.limits
        tails = "\n".join(failures.output_tail(o, self.redactor) for o in self._outputs)
        extra = [limits.pattern(p.regex, p.reset, p.source) for p in config.patterns]
        limit = limits.find(tails, extra)
        if limit is None:
            self._limited_since = None
            return False
        now = time.time()
        since = self._limited_since = self._limited_since or now
        wait = limits.plan(
            limit,
            now=now,
            since=since,
            max_wait=config.max_wait,
            default_wait=config.default_wait,
            margin=config.margin,
        )
        st = self.state
        st.limited = {
            "item": item.text,
            "source": limit.source,
            "line": limit.evidence,
            "reset_at": wait.reset_at,
            "until": wait.until,
        }
        fields = {**st.limited, "reset": limits.when(wait.reset_at), "seconds": wait.seconds}
        fields.update(guessed=wait.guessed, ends_run=wait.ends_run)
        if wait.ends_run:
            st.current_item = None
            self.output.event("limited", **fields, exit_code=config.exit_code)
            message = limits.stop_message(limit, wait, since, config.max_wait)
            raise Limited(message, config.exit_code)
        st.phase = None
        self.output.event("limited", **fields)
        self.save()

        def countdown(left: float) -> None:
            until = limits.when(wait.until)
            self.output.event("limited-wait", item=item.text, seconds=left, until=until)

        try:
            limits.wait_out(wait.until, self.stop, countdown)
        finally:
            st.limited = None
        return True

    def _failure(self, item: checklist.Item, failed: StepEntry, agent_seconds: float) -> Failure:
        """The attempt as the broken-agent rule compares it (see failures.py)."""
        untouched = False
        if agent_seconds < failures.AT_ONCE_SECONDS and self.before is not None:
            untouched = (self.after or self._snapshot()) == self.before
        signatures = failures.signatures(
            failed["name"],
            failed["status"],
            failed["output_tail"],
            item.text,
            from_process=failed["from_process"],
            at_once_untouched=untouched,
            stalled=bool(failed.get("stalled")),
        )
        return Failure(
            item=item.text,
            reason=failed["reason"],
            output_tail=failed["output_tail"],
            signatures=signatures,
        )

    def _agent_broken(self, previous: Failure, failure: Failure) -> None:
        """Stop (exit 6): the agent, not the item, is failing. The failure is no strike, and the
        last failure charged to an item stays the one to compare with, so that a run started
        again without a fix stops at its first failure."""
        st = self.state
        skipped = list(st.streak_skipped)
        st.agent_broken = {
            "reason": failure.reason,
            "output_tail": failure.output_tail,
            "items": [previous.item, failure.item],
            "skipped": skipped,
        }
        st.current_item = None
        self.output.event(
            "agent-broken",
            item=failure.item,
            previous_item=previous.item,
            reason=failure.reason,
            output_tail=failure.output_tail,
            skipped=skipped,
            exit_code=ExitCode.AGENT_BROKEN,
        )
        message = (
            f"the agent is broken: it failed the same way on {previous.item!r} and "
            f"{failure.item!r} while the service was healthy ({failure.reason}); "
            "stopped instead of skipping the rest"
        )
        if skipped:
            message += (
                f"; skipped meanwhile: {', '.join(repr(i) for i in skipped)} "
                "(set them back to '- [ ]' to retry them)"
            )
        raise AgentBroken(
            message + ". Fix the agent's set-up and run again.", ExitCode.AGENT_BROKEN
        )

    def _skip(self, item: checklist.Item, strikes: int) -> None:
        text = checklist.read(self.checklist_path)
        current = checklist.find(text, item.text)  # None: the agent rewrote the item's line
        if current is not None:
            checklist.write(self.checklist_path, checklist.mark(text, current, checklist.SKIPPED))
            if self.in_repo:
                message = f"skip: {item.text} ({strikes} failures)"
                git.commit_paths(self.plan.workdir, message, self.checklist_path)
                self.known = None  # HEAD moved
        self._counts = None
        self.state.strikes.pop(item.text, None)
        self.output.event("skip", item=item.text, strikes=strikes)

    def _show_output(self, text: str) -> None:
        """`-v`: the step's output, a line at a time (it arrives in arbitrary chunks), without
        the escape codes that would garble a log file or move a terminal's cursor."""
        *lines, self._partial_line = (self._partial_line + text).split("\n")
        for line in lines:
            self.output.event("output", step=self.state.phase, text=output_text.clean(line))

    def _flush_output(self) -> None:
        if self._partial_line:
            text = output_text.clean(self._partial_line)
            self.output.event("output", step=self.state.phase, text=text)
            self._partial_line = ""

    # -- what the runbook's actions call ---------------------------------------
    def ensure_alive(self, phase: str, context: dict[str, Any]) -> TaskResult:
        started = time.monotonic()
        self.ensure_service(phase, context)
        return TaskResult(ok=True, seconds=time.monotonic() - started)

    def ensure_service(self, phase: str, context: dict[str, Any] | None = None) -> None:
        self.state.phase = phase
        facts = self._facts()
        if context:
            facts["context"] = context
        deaths = self.state.deaths
        self.service.ensure_alive(phase, facts, self.state.iteration)
        if self.state.deaths != deaths:
            self._counts = None  # recovery steps ran

    @property
    def item_in_hand(self) -> str | None:
        """The checklist item this iteration works on, for verify."""
        return self.state.current_item

    def look_at_tree(self) -> git.Snapshot | None:
        """The work tree now, for verify; kept as what the next iteration starts from."""
        self.after = self._snapshot()
        return self.after

    # -- helpers ---------------------------------------------------------------
    def _snapshot(self) -> git.Snapshot | None:
        """HEAD and the changed paths, agent housekeeping left out; None outside a repository."""
        if not self.in_repo:
            return None
        return git.snapshot(self.plan.workdir).without(self.housekeeping)

    def _variables(self, item: checklist.Item) -> dict[str, Any]:
        counts = self.checklist_counts()
        item_vars = {
            "text": item.text,
            "line": item.line,
            "index": item.index,
            "attempts": self.state.strikes.get(item.text, 0),
        }
        variables = {
            **self.plan.variables,
            "iteration": self.state.iteration,
            "item": item_vars,
            "checklist": counts.as_dict(),
            "deaths": self.state.deaths,
            "phase": None,
            **proxy.variables(self.plan, self.proxy),  # agent_base_url
        }
        where = self.plan.runbook.where(("prompt",))
        prompt = self.plan.templar.render(self.model.prompt, variables, where=where)
        variables.update(
            prompt=prompt, prompt_size=len(prompt), prompt_bytes=len(prompt.encode("utf-8"))
        )
        self.iteration_vars = variables
        return variables

    def forget_counts(self) -> None:
        """Something that can change the checklist ran: read its counts again when asked."""
        self._counts = None

    def checklist_counts(self) -> checklist.Counts:
        if self._counts is None:
            self._counts = checklist.counts(checklist.read(self.checklist_path))
        return self._counts

    def _facts(self) -> Facts:
        variables = self.iteration_vars
        counts = self.checklist_counts()
        return {
            "iteration": self.state.iteration,
            "item": variables.get("item"),
            **(Facts(step=self.failed_step) if self.failed_step else Facts()),
            "prompt_size": variables.get("prompt_size"),
            "prompt_bytes": variables.get("prompt_bytes"),
            "checklist": counts.as_dict(),
            "variables": {**variables, "checklist": counts.as_dict()},
        }

    def save(self, status_only: bool = False) -> None:
        """Persist state and status; a full disk is reported, and the loop goes on. Each
        warning names the file it is about (the error carries its path): the state, the
        status, or the checklist whose counts the status could not take."""
        if not status_only:
            try:
                self.store.save(self.state)
            except FatalError as exc:
                self.output.event("warning", message=f"state not saved: {exc}")
        try:
            self.store.write_status(self._status())
        except FatalError as exc:
            self.output.event("warning", message=f"status not saved: {exc}")

    def _warn(self, message: str) -> None:
        self.output.event("warning", message=message)

    def _status(self) -> dict[str, Any]:
        st = self.state
        counts: checklist.Counts | None
        try:
            counts = self._last_counts = self.checklist_counts()
        except FatalError as exc:  # the run stops on it (or has): the status still says so
            counts = self._last_counts
            if st.status == "running":  # an ended run's status has the error already
                message = f"status.json keeps the last checklist counts: {exc}"
                self.output.event("warning", message=message)
        return {
            "status": st.status,
            "pid": st.pid,
            "running": st.status == "running",
            "iteration": st.iteration,
            "item": st.current_item,
            "phase": st.phase,
            **(counts.as_dict() if counts else {}),  # none: the checklist was never read
            "deaths": st.deaths,
            "last_death": st.last_death,
            "last_start": st.last_start,
            "agent_broken": st.agent_broken,
            "limited_until": st.limited["until"] if st.limited else None,
            "limited": st.limited,
            "failure": st.error,  # why the run failed; "error" is a reader's (no status read)
            **pause.status_fields(self),  # paused, pause, step_started, attempts
            "hang_bound": self._hang_bound(),
            "updated": time.time(),
            "workdir": str(self.plan.workdir),
        }

    def _show_bound(self) -> None:
        """After a watch round: the status follows the hang bound (whole seconds) mid-step."""
        bound = self._hang_bound()
        shown = None if bound is None else round(bound["seconds"])
        if shown != self._bound_shown:
            self._bound_shown = shown
            self.save(status_only=True)

    def _hang_bound(self) -> dict[str, Any] | None:
        """The progress probes' hang bound now (docs: hangs), once a check computed one."""
        health = getattr(self, "health", None)  # the first status is written before it exists
        found = health.hang_bound() if health is not None else None
        return None if found is None else {"seconds": round(found[0], 1), "why": found[1]}

    def _summary(self, text: str, stopped: bool = False) -> None:
        counts = checklist.counts(text)
        self.output.event(
            "summary",
            stopped_at_max=stopped,
            iterations=self.state.iteration - self.state.run_from,  # this run's
            done=counts.done,
            todo=counts.todo,
            skipped=counts.skipped,
            deaths=self.state.deaths,
            signatures=dict(Counter(self.service.signatures).most_common()),
            seconds=round(time.monotonic() - self.started, 1),
        )


def _housekeeping_patterns(plan: Plan) -> list[str]:
    """The agents' own files: the built-in list and every verify step's `ignore:`."""
    patterns = list(housekeeping.DEFAULT_IGNORE)
    for spec in plan.runbook.loop_steps:
        if spec.kind == "verify" and spec.params is not None:
            patterns.extend(p for p in spec.params.ignore if p not in patterns)
    return patterns
