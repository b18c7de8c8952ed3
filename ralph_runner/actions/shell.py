"""`shell: STRING`: run by bash on the task's connection; every {{ value }} is one shell word."""

from __future__ import annotations

from ralph_runner.actions import TaskContext, TaskResult

KEY = "shell"
Params = str


def describe(params: str, ctx: TaskContext) -> str:
    return ctx.templar.render(params, ctx.variables, shell=True, where=ctx.where)


def run(params: str, ctx: TaskContext) -> TaskResult:
    result = ctx.connection.shell(describe(params, ctx), **ctx.process_options())
    return TaskResult.from_process(result)
