"""What a run needs of its workdir before its first iteration, checked by the run and by
`--check` alike (issue 31: `--check` passed where the run then failed at once).

The workdir must be a directory, the checklist a file in it, and the workdir a git repository
when a `verify` step needs commits. Each problem points at the runbook key to fix: `workdir:`,
`checklist.path`, the verify step; the death log and its records, where they exist, must be
regular files of the run's user (no link is written through). Nothing is written; git is asked
(`git rev-parse`, read-only) only when a verify step needs commits, as the run asks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ralph_runner.errors import Problem
from ralph_runner.runbook.plan import Plan
from ralph_runner.workspace import checklist, git

CREATE_HINT = "create it with one '- [ ] item' a line"


def problems(plan: Plan) -> list[Problem]:
    """The problems that would stop the run before its first iteration, each at its key."""
    runbook = plan.runbook
    workdir = plan.workdir
    if not _is(workdir, Path.is_dir):
        what = "is no directory" if _is(workdir, Path.exists) else "does not exist"
        message = f"the workdir {workdir} {what} (the loop runs in it)"
        return [replace(runbook.where(("workdir",)), message=message)]
    checklist_path = plan.path(("checklist", "path"), plan.model.checklist.path)
    found: list[Problem] = []
    at_checklist = runbook.where(("checklist", "path"))
    if _is(checklist_path, Path.is_dir):
        message = f"the checklist {checklist_path} is a directory, not a file"
        found.append(replace(at_checklist, message=message))
    elif not checklist.present(checklist_path):
        message = f"no checklist at {checklist_path}; {CREATE_HINT}"
        found.append(replace(at_checklist, message=message))
    committing = [
        spec
        for spec in runbook.loop_steps
        if spec.kind == "verify" and (spec.params is None or spec.params.committed)
    ]
    if committing and not git.is_repo(workdir):
        message = f"verify needs a commit, but {workdir} is no git repository"
        message += " (`git init` there, and commit the checklist)"
        found.append(replace(committing[0].where, message=message))
    return found


def _is(path: Path, test: Callable[[Path], bool]) -> bool:
    """`test(path)`, False where the system refuses the path (a name too long)."""
    try:
        return test(path)
    except OSError:
        return False
