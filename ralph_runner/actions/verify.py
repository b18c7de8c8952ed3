"""`verify: {checked: true, committed: true}`: did the agent tick its item and commit it?"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ralph_runner.actions import TaskContext, TaskResult
from ralph_runner.workspace import checklist
from ralph_runner.workspace.git import Snapshot

KEY = "verify"
LOOP_ONLY = True  # it checks the item the loop is working on
AGENT = False  # it looks at the checklist and git: nothing to watch
QUICK = True  # milliseconds: status.json is not rewritten for it


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checked: bool = True  # the item is ticked ("[x]" or "[X]") in the checklist
    committed: bool = True  # HEAD moved during the iteration and the worktree is clean
    # More paths (gitignore patterns) that are the agent's own files, never "uncommitted
    # changes": on top of the built-in `.aider*` (aider's history and cache files).
    ignore: list[str] = []


def describe(params: Params | None, ctx: TaskContext) -> str:
    params = params or Params()
    wants = [w for w, on in (("checked", params.checked), ("committed", params.committed)) if on]
    return "verify " + (" and ".join(wants) or "nothing")


def run(params: Params | None, ctx: TaskContext) -> TaskResult:
    """The loop knows the item in hand and the tree the iteration began with."""
    params = params or Params()
    loop = ctx.loop()
    problems = []
    if params.checked and not _ticked(loop.checklist_path, loop.item_in_hand or ""):
        problems.append("item not ticked")
    if params.committed:
        problems.extend(_commit_problems(loop.before, loop.look_at_tree()))
    return TaskResult(ok=not problems, output="; ".join(problems) or "verified")


def _ticked(checklist_path: Path, item_text: str) -> bool:
    found = checklist.find(checklist.read(checklist_path), item_text)
    return found is not None and found.mark == checklist.DONE


def _commit_problems(before: Snapshot | None, after: Snapshot | None) -> list[str]:
    """A new HEAD and a clean tree (housekeeping already left out), or what is missing."""
    if after is None or after.head == (before.head if before else None):
        return ["no new commit"]
    if not after.clean:
        return ["uncommitted changes"]
    return []
