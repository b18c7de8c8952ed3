"""Where an attempt works and how its work lands: the Iteration's (iteration.py) strategy.

`InPlace` (`loop.workers: 1`): the attempt works in the workdir itself; its work is there when it
ends, and the next attempt starts from the tree verify saw when nothing moved it. `InWorktrees`
(N > 1, docs: workers): each attempt works in a git worktree of its own on a branch from the head;
a verified attempt lands as a whole (workspace/worktrees.py: its commits replayed onto the head
as it is now, then one fast-forward), one landing at a time; a landing that conflicts is retried
on the new head, no strike, up to CONFLICT_RETRIES times, then its next conflict is a failure.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ralph_runner import events
from ralph_runner.loop.iteration import DONE, Landed, Landing
from ralph_runner.workspace import git, worktrees

if TYPE_CHECKING:
    from ralph_runner.loop.context import RunContext
    from ralph_runner.loop.iteration import Attempt, Iteration

CONFLICT_RETRIES = 3  # conflicting landings of one item retried before one counts as a failure


class InPlace:
    """The one worker's: in the workdir, nothing to land."""

    alone = True

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.known: git.Snapshot | None = None  # the tree after the last attempt, if known
        self.lock = threading.Lock()  # a skip's commit (one attempt at a time: uncontended)

    def prepare(self, attempt: Attempt) -> git.Snapshot | None:
        """The tree it starts from: what the last attempt's verify saw, else a look."""
        start, self.known = self.known or self.run.snapshot(attempt.workdir), None
        return start

    def variables(self, attempt: Attempt) -> dict[str, object]:
        return {}

    def began(self, attempt: Attempt) -> None:
        """Its start said by the iteration's own event alone."""

    def land(self, attempt: Attempt, it: Iteration) -> Landed:
        return DONE

    def retried(self, attempt: Attempt, reason: str, waits: bool) -> None:
        """A retry said by the iteration's own events alone."""

    def ended(self, attempt: Attempt, it: Iteration) -> None:
        self.known = it.next_start()

    def release(self, attempt: Attempt) -> None:
        """Nothing to remove: the workdir is the operator's."""

    def clean(self) -> list[str]:
        return []


class InWorktrees:
    """N workers': a worktree each, landed by a fast-forward (see the module)."""

    alone = False

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.top = git.top(run.plan.workdir)
        self.lock = threading.Lock()  # one landing (or skip commit, or new worktree) at a time
        self.conflicts: dict[str, int] = {}
        self.checklist_rel = str(run.checklist_path.resolve().relative_to(self.top))
        self.workdir_rel = run.plan.workdir.resolve().relative_to(self.top)

    def prepare(self, attempt: Attempt) -> git.Snapshot | None:
        """A worktree from a head no landing is moving; the tree it starts from."""
        with self.lock:
            attempt.tree = worktrees.add(self.top, attempt.worker, attempt.item.text)
        attempt.workdir = attempt.tree.path / self.workdir_rel
        attempt.checklist_path = attempt.tree.path / self.checklist_rel
        return self.run.snapshot(attempt.workdir)

    def variables(self, attempt: Attempt) -> dict[str, object]:
        return {"workdir": str(attempt.workdir)}

    def began(self, attempt: Attempt) -> None:
        assert attempt.tree is not None and attempt.iteration is not None
        self.run.bus.emit(
            events.WorkerStarted(
                worker=attempt.worker,
                iteration=attempt.iteration.number,
                item=attempt.item.text,
                branch=attempt.tree.branch,
                base=attempt.tree.base,
                strikable=attempt.strikable,
            )
        )

    def land(self, attempt: Attempt, it: Iteration) -> Landed:
        """Its commits on the head as it is now, or a conflict (see the module)."""
        assert attempt.tree is not None
        attempt.at("landing")
        item, bus = attempt.item.text, self.run.bus
        with self.lock:
            try:
                landing = worktrees.land(self.top, attempt.tree, self.checklist_rel, item)
            except worktrees.GitFailed as exc:
                landing = worktrees.Landing(None, 0, str(exc)[:300])
            if landing.head is not None:
                self.conflicts.pop(item, None)
            else:
                conflicts = self.conflicts[item] = self.conflicts.get(item, 0) + 1
                if conflicts > CONFLICT_RETRIES:
                    self.conflicts.pop(item, None)
        if landing.head is not None:
            bus.emit(events.WorkerLanded(worker=attempt.worker, item=item,
                                         commits=landing.commits, head=landing.head))  # fmt: skip
            return DONE
        bus.emit(events.WorkerConflict(worker=attempt.worker, item=item, conflicts=conflicts,
                                       of=CONFLICT_RETRIES, reason=landing.reason))  # fmt: skip
        if conflicts <= CONFLICT_RETRIES:
            return Landed("conflict", landing.reason)
        return Landed("failed", f"its landing conflicted {conflicts} times", landing.reason)

    def retried(self, attempt: Attempt, reason: str, waits: bool) -> None:
        self.run.bus.emit(
            events.WorkerRetry(
                worker=attempt.worker, item=attempt.item.text, reason=reason, waits=waits
            )
        )

    def ended(self, attempt: Attempt, it: Iteration) -> None:
        """Nothing to keep: the next attempt starts in a new worktree."""

    def release(self, attempt: Attempt) -> None:
        if attempt.tree is not None:
            with self.lock:
                worktrees.remove(self.top, attempt.tree)

    def clean(self) -> list[str]:
        """What a killed run left: worktrees and the branches it made."""
        return worktrees.stale(self.top)


def for_workers(run: RunContext, workers: int) -> Landing:
    return InPlace(run) if workers == 1 else InWorktrees(run)
