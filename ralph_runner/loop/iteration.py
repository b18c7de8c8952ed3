"""One iteration of the loop: one checklist item's attempt, from its variables to its outcome.

The run-wide `Runner` (runner.py) picks the item, runs the steps and looks after the service;
an `Iteration` keeps what belongs to the attempt alone (the work tree when it began and when
verify looked at it, its failed step, its process steps' output and time) and settles it by the
loop's rules: done; retried with no strike (the service died during it); waited out (the
agent's usage limit); a strike, and at `strikes` a skip; or the end of the run when the agent
fails the same way on two items (AgentBroken). Whatever ends it says so once, with
`IterationEnded`: the outcome the iteration history writes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ralph_runner import events
from ralph_runner.actions import UNWATCHED, TaskResult
from ralph_runner.deaths.record import ItemEntry, StepEntry
from ralph_runner.errors import AgentBroken, ExitCode, GaveUp, Interrupted, Limited
from ralph_runner.loop import failures, limits, pause
from ralph_runner.loop.failures import Failure
from ralph_runner.workspace import checklist, git

if TYPE_CHECKING:
    from ralph_runner.durable.redaction import Redactor
    from ralph_runner.loop.state import State
    from ralph_runner.output import EventBus
    from ralph_runner.runbook.loader import TaskSpec
    from ralph_runner.runbook.plan import Plan


class Run(Protocol):
    """What an iteration needs of the run it belongs to (runner.Runner)."""

    plan: Plan
    bus: EventBus
    state: State
    stop: threading.Event
    redactor: Redactor
    checklist_path: Path
    in_repo: bool
    limited_since: float | None  # the first of the limited attempts in a row

    def save(self, status_only: bool = False) -> None: ...
    def forget_counts(self) -> None: ...
    def snapshot(self) -> git.Snapshot | None: ...


class Iteration:
    """One attempt at `item`; `before` is the work tree when it began (None: no repository)."""

    def __init__(self, run: Run, item: checklist.Item, before: git.Snapshot | None) -> None:
        self.run, self.item, self.before = run, item, before
        self.number = run.state.iteration
        self.deaths_before = run.state.deaths
        self.variables: dict[str, object] = {}  # what its steps' templates see
        self.attempts = run.state.strikes.get(item.text, 0)  # the item's strikes before it
        # the item as its templates see it (`item`) and its death records show it
        self.entry: ItemEntry = {
            "text": item.text,
            "line": item.line,
            "index": item.index,
            "attempts": self.attempts,
        }
        self.counts: checklist.Counts | None = None  # the checklist when it began
        self.prompt = ""
        self.after: git.Snapshot | None = None  # the work tree when verify looked at it
        self.after_verify = False  # a step other than a check ran after verify looked
        self.head_moved = False  # the loop committed (a skip): what verify saw is stale
        self.failed_step: StepEntry | None = None  # its failed (or killed) step
        self.outputs: list[str] = []  # its process steps' output, for limits.py
        self.agent_seconds = 0.0  # its process steps' time
        self.ended = False  # it said how it ended (IterationEnded)

    # -- its variables and its steps -------------------------------------------------------
    def render(self, counts: checklist.Counts, extra: dict[str, object]) -> dict[str, object]:
        """The steps' variables: the plan's, the item, the counts, the rendered prompt."""
        run, st = self.run, self.run.state
        self.counts = counts
        variables: dict[str, object] = {
            **run.plan.variables,
            "iteration": st.iteration,
            "item": dict(self.entry),
            "checklist": counts.as_dict(),
            "deaths": st.deaths,
            "phase": None,
            **extra,
        }
        where = run.plan.runbook.where(("prompt",))
        prompt = self.prompt = run.plan.templar.render(
            run.plan.model.prompt, variables, where=where
        )
        variables.update(prompt=prompt, prompt_size=len(prompt), prompt_bytes=self.prompt_bytes)
        self.variables = variables
        return variables

    @property
    def prompt_bytes(self) -> int:
        return len(self.prompt.encode("utf-8"))

    def started(self) -> events.Iteration:
        """The event that opens it (the history's line)."""
        counts = self.counts or checklist.Counts(0, 0, 0, 0, 0)
        return events.Iteration(
            iteration=self.number,
            item=self.item.text,
            attempts=self.attempts,
            done=counts.done,
            todo=counts.todo,
            skipped=counts.skipped,
            deaths=self.deaths_before,
            prompt_size=len(self.prompt),
            prompt_bytes=self.prompt_bytes,
        )

    def took(self, spec: TaskSpec, result: TaskResult) -> None:
        """A loop step ran: count its time and output, keep the first failure."""
        if spec.kind not in UNWATCHED:
            self.agent_seconds += result.seconds
            self.outputs.append(result.output)
        if self.after is not None and spec.kind not in ("verify", "ensure_alive"):
            self.after_verify = True
        if not result.ok and not spec.task.ignore_errors and self.failed_step is None:
            self.failed_step = step_entry(spec, result, self.run.redactor)

    def look_at_tree(self) -> git.Snapshot | None:
        """The work tree now, for verify; what the next iteration starts from."""
        self.after = self.run.snapshot()
        return self.after

    def died(self) -> bool:
        return self.run.state.deaths > self.deaths_before

    def next_start(self) -> git.Snapshot | None:
        """What the next iteration's `before` is, when known without a look: what verify saw,
        unless something ran after it, the service died, or the loop committed."""
        if self.died() or self.after_verify or self.head_moved:
            return None
        return self.after

    # -- its end ------------------------------------------------------------------------------
    def settle(self) -> None:
        """The outcome by the loop's rules (see the module's text); the state saved."""
        run, st, item, failed = self.run, self.run.state, self.item, self.failed_step
        if failed is None:
            run.limited_since = None
            st.strikes.pop(item.text, None)
            st.last_failure, st.streak_skipped = None, []
            run.bus.emit(events.Done(item=item.text))
            self.end("done")
        elif self.died():
            run.bus.emit(events.Retry(item=item.text, reason=failed["reason"]))
            self.end("death", reason=failed["reason"])
        elif self._waited_out():
            pass  # a usage limit: no strike, no broken agent; the item comes again
        else:
            self._strike(failed)
        st.current_item = None
        run.save()

    def end(
        self,
        outcome: events.Outcome,
        *,
        reason: str | None = None,
        strikes: int | None = None,
        limit: events.LimitFacts | None = None,
    ) -> None:
        """Say how it ended, once: the history's line, and --json's."""
        if self.ended:
            return
        self.ended = True
        ended = events.IterationEnded(
            iteration=self.number,
            item=self.item.text,
            outcome=outcome,
            reason=reason,
            strikes=strikes,
            limit=limit,
        )
        self.run.bus.emit(ended)

    def cut_short(self, exc: BaseException) -> None:
        """The run ends inside it (or `pause --now` stops it): say how, unless it said already."""
        if isinstance(exc, pause.PausedNow):
            self.end("paused")  # no outcome counted: the item comes again after `resume`
        elif isinstance(exc, GaveUp):
            self.end("gave-up")
        elif isinstance(exc, Interrupted):
            self.end("interrupted")
        else:
            self.end("failed")

    def _strike(self, failed: StepEntry) -> None:
        run, st, item = self.run, self.run.state, self.item
        failure = self.failure(failed)
        self.charge(failure)
        strikes = st.strikes.get(item.text, 0) + 1
        st.strikes[item.text] = strikes
        most = run.plan.model.checklist.strikes
        run.bus.emit(
            events.Strike(
                item=item.text,
                strikes=strikes,
                of=most,
                reason=failure.reason,
                output_tail=failure.output_tail,
            )
        )
        outcome: events.Outcome = "strike"
        if strikes >= most:
            self._skip(strikes)
            st.streak_skipped.append(item.text)
            outcome = "skipped"
        self.end(outcome, reason=failure.reason, strikes=strikes)

    def failure(self, failed: StepEntry) -> Failure:
        """The attempt as the broken-agent rule compares it (see failures.py)."""
        untouched = False
        if self.agent_seconds < failures.AT_ONCE_SECONDS and self.before is not None:
            untouched = (self.after or self.run.snapshot()) == self.before
        signatures = failures.signatures(
            failed["name"],
            failed["status"],
            failed["output_tail"],
            self.item.text,
            from_process=failed["from_process"],
            at_once_untouched=untouched,
            stalled=bool(failed.get("stalled")),
        )
        return Failure(
            item=self.item.text,
            reason=failed["reason"],
            output_tail=failed["output_tail"],
            signatures=signatures,
        )

    def charge(self, failure: Failure) -> None:
        """The broken-agent rule: the same failure as the last one charged, on another item,
        stops the run (AgentBroken); otherwise this one is the last to compare with."""
        st = self.run.state
        previous = Failure.from_dict(st.last_failure)
        if previous is not None and failure.same_as(previous):
            if previous.item != self.item.text:
                self._agent_broken(previous, failure)
        else:
            st.streak_skipped = []
        st.last_failure = failure.as_dict()

    def _waited_out(self) -> bool:
        """A failed attempt whose agent said "usage limit" (limits.py) is no strike and no
        failure for the broken-agent rule: wait for the reset (plus the margin) and retry the
        item, or stop (Limited, limits.exit_code) when it is further than limits.max_wait."""
        wait = self.limited()
        if wait is None:
            return False
        run, item, st = self.run, self.item, self.run.state

        def countdown(left: float) -> None:
            until = limits.when(wait.until)
            run.bus.emit(events.LimitedWait(item=item.text, seconds=left, until=until))

        try:
            limits.wait_out(wait.until, run.stop, countdown)
        finally:
            st.limited = None
        return True

    def limited(self) -> limits.Wait | None:
        """A usage limit in its output, said (`limited`, its history line, state.limited) and
        its wait planned; Limited raised when the reset is beyond limits.max_wait. None: no
        limit. The wait itself is the caller's (one worker waits here; a pool holds all)."""
        run, item = self.run, self.item
        config = run.plan.model.limits
        tails = "\n".join(failures.output_tail(o, run.redactor) for o in self.outputs)
        extra = [limits.pattern(p.regex, p.reset, p.source) for p in config.patterns]
        limit = limits.find(tails, extra)
        if limit is None:
            run.limited_since = None
            return None
        now = time.time()
        since = run.limited_since = run.limited_since or now
        wait = limits.plan(
            limit,
            now=now,
            since=since,
            max_wait=config.max_wait,
            default_wait=config.default_wait,
            margin=config.margin,
        )
        st = run.state
        st.limited = {
            "item": item.text,
            "source": limit.source,
            "line": limit.evidence,
            "reset_at": wait.reset_at,
            "until": wait.until,
        }
        said = events.Limited(
            item=item.text,
            source=limit.source,
            line=limit.evidence,
            reset_at=wait.reset_at,
            until=wait.until,
            reset=limits.when(wait.reset_at),
            seconds=wait.seconds,
            guessed=wait.guessed,
            ends_run=wait.ends_run,
            exit_code=config.exit_code if wait.ends_run else None,
        )
        facts: events.LimitFacts = {
            "source": said.source,
            "seconds": said.seconds,
            "reset": said.reset,
        }
        if wait.ends_run:
            st.current_item = None
            run.bus.emit(said)
            self.end("limited", limit=facts)
            message = limits.stop_message(limit, wait, since, config.max_wait)
            raise Limited(message, config.exit_code)
        st.phase = None
        run.bus.emit(said)
        self.end("limited", limit=facts)
        run.save()
        return wait

    def _agent_broken(self, previous: Failure, failure: Failure) -> None:
        """Stop (exit 6): the agent, not the item, is failing. The failure is no strike, and the
        last failure charged to an item stays the one to compare with, so that a run started
        again without a fix stops at its first failure."""
        st = self.run.state
        skipped = list(st.streak_skipped)
        st.agent_broken = {
            "reason": failure.reason,
            "output_tail": failure.output_tail,
            "items": [previous.item, failure.item],
            "skipped": skipped,
        }
        st.current_item = None
        self.run.bus.emit(
            events.AgentBroken(
                item=failure.item,
                previous_item=previous.item,
                reason=failure.reason,
                output_tail=failure.output_tail,
                skipped=skipped,
                exit_code=ExitCode.AGENT_BROKEN,
            )
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

    def _skip(self, strikes: int) -> None:
        run, item = self.run, self.item
        text = checklist.read(run.checklist_path)
        current = checklist.find(text, item.text)  # None: the agent rewrote the item's line
        if current is not None:
            checklist.write(run.checklist_path, checklist.mark(text, current, checklist.SKIPPED))
            if run.in_repo:
                message = f"skip: {item.text} ({strikes} failures)"
                git.commit_paths(run.plan.workdir, message, run.checklist_path)
                self.head_moved = True
        run.forget_counts()
        run.state.strikes.pop(item.text, None)
        run.bus.emit(events.Skip(item=item.text, strikes=strikes))


def step_entry(spec: TaskSpec, result: TaskResult, redactor: Redactor) -> StepEntry:
    """A failed or killed step as reports show it: how it ended and its last words."""
    status = failures.status_text(
        result.exit_code, result.timed_out, result.cancelled, result.output, result.stalled
    )
    from_process = spec.kind not in UNWATCHED
    tail = failures.output_tail(result.output, redactor) if from_process else ""
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
