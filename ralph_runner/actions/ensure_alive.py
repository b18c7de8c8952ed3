"""`ensure_alive: {phase: NAME}`: probe the service; if dead, capture, report and recover.

The work is the loop's (`ctx.loop().ensure_alive`): this module only names the step.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ralph_runner.actions import TaskContext, TaskResult

KEY = "ensure_alive"
LOOP_ONLY = True  # it recovers through the loop, which a recovery or a capture is already part of
AGENT = False  # no process of the agent: the loop watches nothing while it runs
QUICK = True  # milliseconds on a healthy service: status.json is not rewritten for it


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    phase: str = "check"  # the phase a death found here is recorded with, e.g. start, post-step
    context: dict[str, object] = {}  # extra facts recorded with a death found by this step


def describe(params: Params | None, ctx: TaskContext) -> str:
    return f"ensure_alive (phase {(params or Params()).phase})"


def run(params: Params | None, ctx: TaskContext) -> TaskResult:
    params = params or Params()
    context = ctx.templar.render_data(params.context, ctx.variables, where=ctx.where)
    return ctx.loop().ensure_alive(params.phase, context)
