"""One iteration of the loop: one checklist item's attempt, from its variables to its outcome.

The scheduler (scheduler.py) picks the item, the attempt's steps run in steps.py; an `Iteration`
keeps what belongs to the attempt alone (the work tree when it began and when verify looked at
it, its failed step, its process steps' output and time) and settles it by the loop's rules,
all of them here, whether one worker or many: done (its work landed: `landing`, in place or a
worktree's fast-forward); a landing that conflicted, retried; retried with no strike (the
service died during it); a usage limit (the run holds until its reset: `hold`); deferred with
no strike (an earlier item was unsettled when it started); a strike, and at `strikes` a skip;
or the end of the run when the agent fails the same way on two items (AgentBrokenError). Whatever
ends it says so once, with `IterationEnded`: the outcome the iteration history writes.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from ralph_runner import events
from ralph_runner.actions import UNWATCHED, TaskResult
from ralph_runner.deaths.record import ItemEntry, StepEntry
from ralph_runner.errors import AgentBrokenError, ExitCode, GaveUp, Interrupted, LimitedError
from ralph_runner.loop import failures, limits
from ralph_runner.loop.failures import Failure
from ralph_runner.output.text import shorten
from ralph_runner.process import output_text
from ralph_runner.workspace import checklist, git, worktrees

if TYPE_CHECKING:
    from ralph_runner.durable.redaction import Redactor
    from ralph_runner.loop.context import RunContext
    from ralph_runner.loop.limit_hold import Hold
    from ralph_runner.runbook.loader import TaskSpec


# the run's service check (steps.Work.ensure_service): healthy, or recovered, or GaveUp
ServiceCheck = Callable[["Attempt | None", str, "dict[str, object] | None"], None]


@dataclass(eq=False)
class Attempt:
    """Worker `worker`'s attempt at `item`, in `workdir` (the run's, or its worktree's): where
    it works and what it does now. The one worker of `loop.workers: 1` works in place (`alone`:
    the run's state follows its item and phase, its events name no worker). It is also what the
    loop's own actions see of the loop (actions.LoopRuntime: verify, ensure_alive)."""

    run: RunContext
    check_service: ServiceCheck  # the run's one `ensure_service` (steps.py)
    worker: int
    alone: bool  # the run's one worker, in place
    item: checklist.Item
    strikable: bool  # every earlier item was settled when it started
    workdir: Path
    checklist_path: Path
    tree: worktrees.Tree | None = None
    phase: str | None = "starting"
    iteration: Iteration | None = None
    agent_step: str | None = None  # the process step running now: what --now and a death kill
    sent: bool = False  # a process step (the agent: its prompt) has started: in flight
    step_cancel: threading.Event | None = None  # the running step's cancel
    paused: bool = False  # `pause --now` killed its step: no outcome, the item comes again
    killed: threading.Event = field(default_factory=threading.Event)  # the run is stopping
    thread: threading.Thread | None = None
    lines: output_text.Lines = field(default_factory=output_text.Lines)  # `-v`'s lines

    @property
    def label(self) -> int | None:
        """The worker's number in its events; None for the one worker (as it always was)."""
        return None if self.alone else self.worker

    def at(self, phase: str | None) -> None:
        """What it does now, for status.json: the run's phase too when it is the only one."""
        self.phase = phase
        if self.alone:
            self.run.state.phase = phase

    def kill_step(self) -> None:
        """Cancel its running process step (a death, `pause --now`, the run's stop)."""
        cancel = self.step_cancel
        if cancel is not None and self.agent_step is not None:
            cancel.set()

    # -- actions.LoopRuntime: what verify and ensure_alive see of the loop ------------------
    @property
    def item_in_hand(self) -> str | None:
        return self.item.text

    @property
    def before(self) -> git.Snapshot | None:
        return self.iteration.before if self.iteration else None

    def look_at_tree(self) -> git.Snapshot | None:
        if self.iteration is None:
            return self.run.snapshot(self.workdir)
        return self.iteration.look_at_tree()

    def ensure_alive(self, phase: str, context: dict[str, object]) -> TaskResult:
        started = time.monotonic()
        self.check_service(self, phase, context)
        return TaskResult(ok=True, seconds=time.monotonic() - started)


@dataclass(frozen=True)
class Landed:
    """How a landing went: "done"; a "conflict" to retry from scratch; a "failed" one (it
    conflicted more than CONFLICT_RETRIES times), with why and git's last words."""

    outcome: Literal["done", "conflict", "failed"]
    reason: str = ""
    tail: str = ""


DONE = Landed("done")


class Landing(Protocol):
    """Where an attempt works and how its work lands (landing.py): in place, or worktrees."""

    alone: bool  # the run's one worker, in place
    lock: threading.Lock  # held by a landing, a skip's commit, a new worktree

    def prepare(self, attempt: Attempt) -> git.Snapshot | None: ...
    def variables(self, attempt: Attempt) -> dict[str, object]: ...
    def began(self, attempt: Attempt) -> None: ...
    def land(self, attempt: Attempt, it: Iteration) -> Landed: ...
    def retried(self, attempt: Attempt, reason: str, waits: bool) -> None: ...
    def ended(self, attempt: Attempt, it: Iteration) -> None: ...
    def release(self, attempt: Attempt) -> None: ...
    def clean(self) -> list[str]: ...


SUBJECT = 60  # an item's characters in the subject of the loop's own commits (skip, set aside)


class Iteration:
    """One attempt at its item; `before` is the work tree when it began (None: no repository)."""

    def __init__(
        self,
        run: RunContext,
        attempt: Attempt,
        before: git.Snapshot | None,
        landing: Landing,
        hold: Hold,
    ) -> None:
        item = attempt.item
        self.run, self.attempt, self.item, self.before = run, attempt, item, before
        self.landing, self.hold = landing, hold
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
            "deaths": run.blame.deaths_of(item.text),  # a runbook may send less on a retry
        }
        self.counts: checklist.Counts | None = None  # the checklist when it began
        self.prompt = ""
        self.after: git.Snapshot | None = None  # the work tree when verify looked at it
        self.after_verify = False  # a step other than a check ran after verify looked
        self.head_moved = False  # the loop committed (a skip): what verify saw is stale
        self.failed_step: StepEntry | None = None  # its failed (or killed) step
        self.outputs: list[str] = []  # its process steps' output, for limits.py
        self.agent_seconds = 0.0  # its process steps' time
        self.outcome: events.Outcome | None = None  # how it ended, once said (IterationEnded)

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

    def started(self) -> events.IterationStarted:
        """The event that opens it (the history's line)."""
        counts = self.counts or checklist.Counts(0, 0, 0, 0, 0)
        return events.IterationStarted(
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
        self.after = self.run.snapshot(self.attempt.workdir)
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
        attempt, landing = self.attempt, self.landing
        if failed is None:
            landed = landing.land(attempt, self)
            if landed.outcome == "done":
                with run.lock:
                    self.hold.since = None
                    st.strikes.pop(item.text, None)
                    st.last_failure, st.streak_skipped = None, []  # the agent works
                    run.counts.forget()
                run.bus.emit(events.Done(item=item.text))
                self.end("done")
            elif landed.outcome == "conflict":
                self.end("conflict", reason=landed.reason)
            else:
                self._strike(landed.reason, landed.tail)
        elif self.died() and run.blame.guilty(item.text):
            self._set_aside()
        elif self.died():
            run.bus.emit(events.Retry(item=item.text, reason=failed["reason"]))
            landing.retried(attempt, "the service died", waits=False)
            self.end("death", reason=failed["reason"])
        elif (wait := self.limited()) is not None:  # LimitedError beyond limits.max_wait
            self.hold.extend(item.text, wait)  # no strike: the run holds until the reset
        elif not attempt.strikable:
            reason = "an earlier item was in flight or unlanded when it started"
            landing.retried(attempt, reason, waits=True)
            self.end("deferred", reason=failed["reason"])
        else:
            failure = self.failure(failed)
            self.charge(failure)  # the broken-agent rule: AgentBrokenError ends the run
            self._strike(failure.reason, failure.output_tail)
        with run.lock:
            if not self.died():
                run.blame.cleared(item.text)  # it was in flight and the server lived
            if attempt.alone and self.outcome != "limited":  # a limit's item is held, in hand
                st.current_item = None
        landing.ended(attempt, self)
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
        if self.outcome is not None:
            return
        self.outcome = outcome
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
        """The run ends inside it: say how, unless it said already."""
        if isinstance(exc, GaveUp):
            self.end("gave-up")
        elif isinstance(exc, Interrupted):
            self.end("interrupted")
        else:
            self.end("failed")

    def _strike(self, reason: str, tail: str) -> None:
        """A strike for its item, and at `checklist.strikes` a skip (`- [!]`, committed)."""
        run, st, item = self.run, self.run.state, self.item
        with run.lock:
            strikes = st.strikes[item.text] = st.strikes.get(item.text, 0) + 1
        most = run.model.checklist.strikes
        run.bus.emit(events.Strike(item=item.text, strikes=strikes, of=most,
                                   reason=reason, output_tail=tail))  # fmt: skip
        outcome: events.Outcome = "strike"
        if strikes >= most:
            with self.landing.lock, run.lock:  # no landing moves the head meanwhile
                message = f"skip: {shorten(item.text, SUBJECT)} ({strikes} failures)"
                self.head_moved = mark_skipped(run, item, message)
                st.strikes.pop(item.text, None)
            run.bus.emit(events.Skip(item=item.text, strikes=strikes))
            with run.lock:
                st.streak_skipped.append(item.text)  # AgentFoundBroken names the items skipped
            outcome = "skipped"
        else:  # a tick from a failed attempt is no work done: the item stays to do
            with self.landing.lock, run.lock:
                message = f"reopen: {shorten(item.text, SUBJECT)} (its attempt failed)"
                self.head_moved = reopen(run, item, message) or self.head_moved
        self.end(outcome, reason=reason, strikes=strikes)

    def _set_aside(self) -> None:
        """The cause of its deaths (loop/blame.py): `- [!]`, committed, no strike, and the run
        goes on; its reason says its deaths, their signature and its prompt's size."""
        run, st, item = self.run, self.run.state, self.item
        deaths = run.blame.deaths_of(item.text)
        recent = run.service.signatures[-deaths:]
        signature = Counter(recent).most_common(1)[0][0] if recent else None
        reason = (
            f"the server died {deaths} times in a row with only this item in flight"
            f" ({signature or 'no signature'}; its prompt {len(self.prompt)} characters)"
        )
        with self.landing.lock, run.lock:  # no landing moves the head meanwhile
            message = f"set aside: {shorten(item.text, SUBJECT)} ({deaths} deaths in a row)"
            self.head_moved = mark_skipped(run, item, message)
            st.strikes.pop(item.text, None)
            st.set_aside.append(item.text)
            run.blame.set_aside(item.text)
            # its deaths were the last ones (in a row: no other death came between them), and
            # their cause is gone: they leave the crash-loop window
            del st.death_times[-deaths:]
        run.bus.emit(
            events.ItemSetAside(
                item=item.text,
                deaths=deaths,
                signature=signature,
                prompt_size=len(self.prompt),
                reason=reason,
            )
        )
        self.end("set-aside", reason=reason)

    def failure(self, failed: StepEntry) -> Failure:
        """The attempt as the broken-agent rule compares it (see failures.py)."""
        untouched = False
        if self.agent_seconds < failures.AT_ONCE_SECONDS and self.before is not None:
            untouched = (self.after or self.run.snapshot(self.attempt.workdir)) == self.before
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
        stops the run (AgentBrokenError); otherwise this one is the last to compare with."""
        st = self.run.state
        previous = Failure.from_dict(st.last_failure)
        if previous is not None and failure.same_as(previous):
            if previous.item != self.item.text:
                self._agent_broken(previous, failure)
        else:
            st.streak_skipped = []
        st.last_failure = failure.as_dict()

    def limited(self) -> limits.Wait | None:
        """A usage limit in its output (limits.py), said (`limited`, its history line,
        state.limited) and its wait planned: no strike, no failure for the broken-agent rule;
        LimitedError (limits.exit_code) when the reset is beyond limits.max_wait. None: no
        limit. The wait is the run's (limit_hold.py): the quota is the agent's, every worker's.
        """
        run, item = self.run, self.item
        config = run.plan.model.limits
        tails = "\n".join(failures.output_tail(o, run.redactor) for o in self.outputs)
        extra = [limits.pattern(p.regex, p.reset, p.source) for p in config.patterns]
        limit = limits.find(tails, extra)
        if limit is None:
            self.hold.since = None
            return None
        now = time.time()
        since = self.hold.since = self.hold.since or now
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
        said = events.UsageLimitHit(
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
            raise LimitedError(message, config.exit_code)
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
            events.AgentFoundBroken(
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
        raise AgentBrokenError(
            message + ". Fix the agent's set-up and run again.", ExitCode.AGENT_BROKEN
        )


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


def reopen(run: RunContext, item: checklist.Item, message: str) -> bool:
    """Undo the tick a failed attempt left on its item (verify failed on "uncommitted changes"
    after the agent ticked it): `- [ ]` again, so the item is tried again, not counted done.
    A tick the agent committed is undone by a commit of the checklist alone; True when the
    head moved."""
    text = checklist.read(run.checklist_path)
    current = checklist.find(text, item.text)
    if current is None or current.mark != checklist.DONE:
        return False
    checklist.write(run.checklist_path, checklist.mark(text, current, checklist.TODO))
    run.counts.forget()
    if not run.in_repo:
        return False
    name = "./" + os.path.relpath(run.checklist_path, run.plan.workdir)
    committed = git.show(run.plan.workdir, "HEAD", name)
    found = checklist.find(committed, item.text) if committed is not None else None
    if found is None or found.mark != checklist.DONE:
        return False  # the tick was not committed: the file is as HEAD has it again
    git.commit_paths(run.plan.workdir, message, run.checklist_path)
    return True


def mark_skipped(run: RunContext, item: checklist.Item, message: str) -> bool:
    """Mark the item `- [!]` in the run's checklist (where the agent left its line) and commit
    it; True when the head moved."""
    text = checklist.read(run.checklist_path)
    current = checklist.find(text, item.text)  # None: the agent rewrote the item's line
    moved = False
    if current is not None:
        checklist.write(run.checklist_path, checklist.mark(text, current, checklist.SKIPPED))
        if run.in_repo:
            git.commit_paths(run.plan.workdir, message, run.checklist_path)
            moved = True
    run.counts.forget()
    return moved
