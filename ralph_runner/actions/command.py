"""`command: [argv...]` (or a string split like a shell would): no shell, no quoting surprises."""

from __future__ import annotations

import shlex

from ralph_runner.actions import TaskContext, TaskResult

KEY = "command"
Params = str | list[str]


def _argv(params: str | list[str], ctx: TaskContext) -> list[str]:
    """A string is rendered with each `{{ }}` quoted as one shell word, then split; a list's
    words are rendered one by one. Splitting first would cut `{{ python }}` into three words."""
    if isinstance(params, str):
        return shlex.split(ctx.templar.render(params, ctx.variables, shell=True, where=ctx.where))
    return [ctx.templar.render(str(word), ctx.variables, where=ctx.where) for word in params]


def describe(params: str | list[str], ctx: TaskContext) -> str:
    return shlex.join(_argv(params, ctx))


def run(params: str | list[str], ctx: TaskContext) -> TaskResult:
    result = ctx.connection.argv(_argv(params, ctx), **ctx.process_options())
    return TaskResult.from_process(result)
