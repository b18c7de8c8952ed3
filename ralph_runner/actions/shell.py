"""`shell: STRING`: run by bash on the task's connection; every {{ value }} is one shell word."""

from __future__ import annotations

from ralph_runner.actions import TaskContext, TaskResult

KEY = "shell"
Params = str


def describe(params: str, ctx: TaskContext) -> str:
    return ctx.templar.render(params, ctx.variables, shell=True, where=ctx.where)


def run(params: str, ctx: TaskContext) -> TaskResult:
    result = ctx.connection.shell(
        describe(params, ctx),
        cwd=ctx.cwd,
        env=ctx.env,
        timeout=ctx.timeout,
        max_output=ctx.max_output,
        cancel=ctx.cancel,
        on_output=ctx.on_output,
    )
    return TaskResult.from_process(result)
