"""`verify: {checked: true, committed: true}`: did the agent tick its item and commit it?"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ralph_runner.actions import TaskContext, TaskResult

KEY = "verify"
LOOP_ONLY = True  # it checks the item the loop is working on


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checked: bool = True  # the item is "- [x]" in the checklist
    committed: bool = True  # HEAD moved during the iteration and the worktree is clean
    # More paths (gitignore patterns) that are the agent's own files, on top of the built-in
    # housekeeping.DEFAULT_IGNORE (aider's .aider*): never "uncommitted changes".
    ignore: list[str] = []


def describe(params: Params | None, ctx: TaskContext) -> str:
    params = params or Params()
    wants = [w for w, on in (("checked", params.checked), ("committed", params.committed)) if on]
    return "verify " + (" and ".join(wants) or "nothing")


def run(params: Params | None, ctx: TaskContext) -> TaskResult:
    return ctx.run.verify(params or Params())
