"""Run one task with Ansible's keywords: when, vars, env, timeout, retries/until/delay, register."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ralph_runner import actions
from ralph_runner.actions import LoopRuntime, TaskContext, TaskResult
from ralph_runner.errors import FatalError
from ralph_runner.output.text import step_ended
from ralph_runner.process.connection import Connection
from ralph_runner.process.execute import DEFAULT_MAX_OUTPUT, IdleWatch
from ralph_runner.process.output_text import clean, explaining_line, one_line
from ralph_runner.runbook.loader import TaskSpec
from ralph_runner.runbook.plan import Plan

DEFAULT_RETRIES_WITH_UNTIL = 3  # Ansible's default when `until` is given


@dataclass
class TaskGroup:
    """Where and how a group of tasks runs (loop steps, collectors, recovery steps)."""

    plan: Plan
    connection: Connection | None = None  # None: the plan's target host
    cwd: Path | None = None
    timeout: float | None = None  # default when the task gives none
    max_output: int = DEFAULT_MAX_OUTPUT
    run: LoopRuntime | None = None  # the loop, for its LOOP_ONLY actions (ensure_alive, verify)
    on_output: Callable[[str], None] | None = None  # live output of the tasks' commands
    # the watch of a task's `idle_timeout` (seconds -> IdleWatch): the loop's (loop/idle.py);
    # None elsewhere. Local commands only: over ssh the CPU and files are not here to watch.
    idle: Callable[[float], IdleWatch] | None = None


def context(
    spec: TaskSpec, group: TaskGroup, variables: dict[str, object], cancel=None
) -> TaskContext:
    """The TaskContext of `spec`: its vars merged, env rendered, connection chosen."""
    task, plan = spec.task, group.plan
    scope = {**variables, **spec.vars}
    scope.update(plan.templar.render_data(task.vars, scope, where=spec.where_of("vars")))
    env = {
        k: plan.templar.render(str(v), scope, where=spec.where_of("env"))
        for k, v in task.env.items()
    }
    delegate = task.delegate_to and plan.templar.render(
        task.delegate_to, scope, where=spec.where_of("delegate_to")
    )
    if delegate:
        conn = plan.connection_for(delegate)
    else:
        conn = group.connection or plan.connection_for(None)
    return TaskContext(
        variables=scope,
        templar=plan.templar,
        connection=conn,
        cwd=(group.cwd or plan.workdir) if conn.name == "local" else None,  # remote: its home
        env=env,
        timeout=task.timeout or group.timeout,
        max_output=group.max_output,
        where=spec.where,
        cancel=cancel,
        run=group.run,
        on_output=group.on_output,
        idle=(
            group.idle(task.idle_timeout)
            if task.idle_timeout and group.idle is not None and conn.name == "local"
            else None
        ),
    )


def describe(spec: TaskSpec, group: TaskGroup, variables: dict[str, object]) -> str:
    """The task rendered for --check: never runs anything."""
    ctx = context(spec, group, variables)
    return actions.KINDS[spec.kind].describe(spec.params, ctx)


def should_run(spec: TaskSpec, group: TaskGroup, variables: dict[str, object]) -> bool:
    when = spec.task.when
    if when is None:
        return True
    scope = {**variables, **spec.vars}
    return bool(group.plan.templar.evaluate(when, scope, where=spec.where_of("when")))


def run(
    spec: TaskSpec,
    group: TaskGroup,
    variables: dict[str, object],
    cancel: threading.Event | None = None,
) -> TaskResult:
    """Run the task (its retries included); registers its result into `variables`."""
    task = spec.task
    if not should_run(spec, group, variables):
        return TaskResult(ok=True, data={"skipped": True})
    ctx = context(spec, group, variables, cancel)
    module = actions.KINDS[spec.kind]
    retries = (
        task.retries
        if task.retries is not None
        else (DEFAULT_RETRIES_WITH_UNTIL if task.until else 0)
    )
    stop = cancel or threading.Event()
    for attempt in range(1, retries + 2):
        result = module.run(spec.params, ctx)
        result.data["attempts"] = attempt
        if task.until:
            scope = {
                **ctx.variables,
                **({task.register_: result.register()} if task.register_ else {}),
            }
            done = bool(ctx.templar.evaluate(task.until, scope, where=spec.where_of("until")))
            result = replace(result, ok=done and not result.cancelled)
        if result.ok or result.cancelled or attempt > retries or stop.wait(task.delay):
            break
    if task.register_:
        variables[task.register_] = result.register()
    return result


@dataclass
class StepsRun:
    """What a block of steps did: each step's result in order (a skipped one's data says
    `skipped`), and the line of the failing step that ended the block, if one did."""

    results: list[tuple[TaskSpec, TaskResult]]
    failure: str | None = None


def run_steps(
    specs: list[TaskSpec],
    group: TaskGroup,
    variables: dict[str, object],
    cancel: threading.Event | None = None,
    starting: Callable[[TaskSpec, str | None], None] = lambda spec, skipped: None,
    between: Callable[[], None] = lambda: None,
    template_errors_end: bool = False,
) -> StepsRun:
    """The steps in order, each under its `when:`; a failing one that does not ignore errors
    ends them. A recovery attempt and the pause and resume blocks run their steps here.
    `starting` hears each step before it runs (`skipped`: why it does not); `between` runs
    after each step that ran (the pause block raises pending signals there). A template error
    is raised (exit 2), or with `template_errors_end` is the failure that ends the steps."""
    done = StepsRun([])
    for spec in specs:
        try:
            if not should_run(spec, group, variables):
                starting(spec, f"when: {spec.task.when}")
                done.results.append((spec, TaskResult(ok=True, data={"skipped": True})))
                continue
            starting(spec, None)
            result = run(spec, group, variables, cancel)
        except FatalError as exc:
            if not template_errors_end:
                raise
            done.failure = f"step {spec.name!r}: {exc}"
            break
        done.results.append((spec, result))
        between()
        if not result.ok and not spec.task.ignore_errors:
            done.failure = failure_line(spec, result)
            break
    return done


def failure_line(spec: TaskSpec, result: TaskResult) -> str:
    """A failed step in a line: which, how it ended, and what it said (the line that explains
    it, an error message, else its last line)."""
    if result.cancelled and not result.timed_out:
        how = "interrupted"  # by our stop (a signal), not by a dying service
    else:
        how = step_ended(result.exit_code, result.timed_out, False) or "failed"
    output = clean(result.output)
    lines = [line for line in output.split("\n") if line.strip()]
    said = explaining_line(output) or (lines[-1] if lines else None)
    return f"step {spec.name!r} failed ({how})" + (f": {one_line(said)}" if said else "")
