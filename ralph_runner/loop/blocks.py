"""The runbook's named blocks: `setup:` and `teardown:` (lifecycle.py), `pause:` and `resume:`
(pause.py), run by one function. Each is tasks as recovery steps are, on the target host
(`tasks.run_steps`): a failing step ends its block unless it ignores errors, a template error
ends the block (the runbook's to fix), never the run. What the block's failure means is its
caller's: setup's ends the run, the others' are reported."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ralph_runner import events

if TYPE_CHECKING:
    from ralph_runner.loop.context import RunContext
    from ralph_runner.runbook.loader import TaskSpec

BlockName = Literal["setup", "teardown", "pause", "resume"]
BlockState = Literal["running", "done", "failed"]


@dataclass
class BlockRun:
    """One block's run, as status.json shows it while it matters."""

    which: BlockName
    state: BlockState = "running"
    error: str | None = None  # why it failed: the step and how it ended
    ran: int = 0  # steps that ran (not skipped by their `when:`)
    held: bool | None = None  # teardown's: whether setup may hold something (lifecycle.py)

    @property
    def completed(self) -> int:
        """Steps that ran to their end without failing the block."""
        return self.ran - (1 if self.error else 0)


def _step_event(which: BlockName, step: str, skipped: str | None) -> events.Event:
    """Each block's step line: the pause's and the resume's have kinds of their own."""
    if which == "pause":
        return events.PauseStep(step=step, skipped=skipped)
    if which == "resume":
        return events.ResumeStep(step=step, skipped=skipped)
    return events.BlockStep(block=which, step=step, skipped=skipped)


def _end_event(which: BlockName, block: BlockRun, seconds: float) -> events.Event:
    ok, ran, error = block.error is None, block.ran, block.error
    if which == "pause":
        return events.PauseSteps(ok=ok, ran=ran, seconds=seconds, error=error)
    if which == "resume":
        return events.ResumeSteps(ok=ok, ran=ran, seconds=seconds, error=error)
    return events.BlockSteps(
        block=which, ok=ok, ran=ran, seconds=seconds, error=error, held=block.held
    )


def run_block(
    run: RunContext,
    which: BlockName,
    specs: list[TaskSpec],
    *,
    cancel: threading.Event,
    between: Callable[[], None],
    shown: Callable[[BlockRun], None] = lambda block: None,
    held: bool | None = None,
) -> BlockRun:
    """Run one block once, its steps in order; its failure is in the result, never raised.
    `between`: called at each step boundary (a pending signal ends setup, pause and resume);
    `shown`: the block in hand, for status.json while it runs."""
    from ralph_runner.runbook import tasks  # the loop's only: `ralph-run pause` needs none

    block = BlockRun(which, held=held)
    if not specs:
        return block
    shown(block)
    run.save_status()
    started = time.monotonic()
    st = run.state
    # What its templates see: the runbook's variables and the loop's counts; no `item` (none is
    # in hand) and no `death`.
    variables = {
        **run.plan.variables,
        "iteration": st.iteration,
        "deaths": st.deaths,
        "checklist": run.counts.get().as_dict(),
        "phase": which,
    }

    def starting(spec: TaskSpec, skipped: str | None) -> None:
        if skipped is None:
            block.ran += 1
        run.bus.emit(_step_event(which, spec.name, skipped or None))

    block.error = tasks.run_steps(
        specs,
        tasks.TaskGroup(run.plan),
        variables,
        cancel,
        starting,
        between=between,
        template_errors_end=True,
    ).failure
    block.state = "failed" if block.error else "done"
    run.counts.forget()  # a step may have changed the checklist
    run.bus.emit(_end_event(which, block, round(time.monotonic() - started, 3)))
    run.save_status()
    return block
