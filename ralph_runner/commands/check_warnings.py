"""`--check`'s warnings: what would not stop the run at once, but would waste it.

An error is what the run refuses at its start (check.py raises those, exit 2). A warning is
what the run would meet later, or what only looks wrong: a command whose first word this host
cannot find (a setup's typo ran 600 s before it showed), a file `needs:` names that does not
exist, a checklist with nothing to do or with lines that look like items and are not, a
CHECKLIST.md not committed (the agent's first commit takes it along, or `verify` fails on it),
state or logs in the workdir that git does not ignore (the agent's `git add -A` commits them).
Each is printed; `--check`'s exit stays 0.

Only what runs on this machine is resolved here: a command for an ssh host is that host's to
find. A first word that is a shell keyword, a builtin, or made at run time (`$(...)`, `$VAR`)
is left alone: the shell knows it, or the run does.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ralph_runner.actions import TaskContext, wait
from ralph_runner.errors import FatalError, Problem
from ralph_runner.runbook import loader, plan, tasks
from ralph_runner.workspace import checklist, git

# Words bash runs itself: never on PATH, never "not found".
_BASH_WORDS = (
    "! . : [ [[ { ( alias bg break builtin case cd command continue declare echo eval exec "
    "exit export false fg for function getopts hash if kill let local printf pushd popd pwd "
    "read readonly return select set shift source test time trap true type typeset ulimit "
    "umask unalias unset until wait while"
)
SHELL_WORDS = frozenset(_BASH_WORDS.split())
GIT_TIMEOUT = 10.0  # seconds for one read-only git question


@dataclass(frozen=True)
class RunsHere:
    """One task of a block whose command runs on this machine, in `cwd`, with its scope."""

    block: str
    spec: loader.TaskSpec
    group: tasks.TaskGroup
    scope: dict[str, object]


def warnings(p: plan.Plan, commands: list[RunsHere]) -> list[str]:
    """Every warning of one host's plan, each one line (file:line:col: key path: what)."""
    found = [*_unfound_commands(commands), *_needs(p)]
    found += _checklist(p) + _inside_workdir(p)
    return found


def _unfound_commands(commands: list[RunsHere]) -> list[str]:
    found = []
    for one in commands:
        try:
            ctx = tasks.context(one.spec, one.group, one.scope)
            if ctx.connection.name != "local":
                continue
            command = _command(one, ctx)
        except FatalError:  # a template error: check.py reports it as the error it is
            continue
        if command is None:
            continue
        word = first_word(command)
        if word is None:
            continue
        cwd = ctx.cwd or Path.cwd()
        path = os.pathsep.join(filter(None, [ctx.env.get("PATH"), os.environ.get("PATH")]))
        why = unfound(word, cwd, path)
        if why:
            said = f"{one.block} step {one.spec.name!r}: {why}; the step will fail (exit 127)"
            found.append(str(_at(one.spec.where, said)))
    return found


def _command(one: RunsHere, ctx: TaskContext) -> str | None:
    """The command line the task runs on its host, rendered; None for a task that runs none."""
    spec = one.spec
    if spec.kind in ("shell", "command"):
        return tasks.describe(spec, one.group, one.scope)
    if spec.kind == wait.KEY and isinstance(spec.params, wait.Resource) and spec.params.command:
        return wait.command_line(spec.params.command, ctx)
    return None


def first_word(command: str) -> str | None:
    """The program a command line starts, past `NAME=value` assignments; None when the shell
    makes it (a builtin, a keyword, an expansion) or the line does not split as shell words."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    for word in words:
        name, equals, _ = word.partition("=")
        if equals and name.isidentifier():
            continue  # an assignment before the command
        if word in SHELL_WORDS or any(c in word for c in "$`(){};|&<>*?"):
            return None
        return word
    return None


def unfound(word: str, cwd: Path, path: str) -> str | None:
    """Why `word` cannot be run from `cwd` with `path`; None when it can."""
    if "/" not in word:
        if shutil.which(word, path=path):
            return None
        return f"`{word}` not found on PATH"
    target = (cwd / os.path.expanduser(word)).resolve()
    shown = f"`{word}`" if str(target) == word else f"`{word}` ({target})"
    if not target.exists():
        return f"{shown}: no such file"
    if target.is_dir() or not os.access(target, os.X_OK):
        return f"{shown}: not an executable file"
    return None


def _needs(p: plan.Plan) -> list[str]:
    """`needs:`: the files that must exist and the programs that must be found, on a local
    host (an ssh host's are that host's)."""
    if p.connection_for(None).name != "local":
        return []
    found = []
    needs = p.model.needs
    for i, template in enumerate(needs.files):
        where = p.runbook.where(("needs", "files", i))
        name = os.path.expanduser(p.templar.render(template, p.variables, where=where))
        target = p.workdir / name
        if not target.exists():
            found.append(str(_at(where, f"no such file: {target}")))
    path = os.environ.get("PATH", "")
    for i, template in enumerate(needs.commands):
        where = p.runbook.where(("needs", "commands", i))
        word = p.templar.render(template, p.variables, where=where)
        why = unfound(word, p.workdir, path)
        if why:
            found.append(str(_at(where, why)))
    return found


def _checklist(p: plan.Plan) -> list[str]:
    """Nothing to do, lines that look like items and are not, a CHECKLIST.md not committed."""
    at = p.runbook.where(("checklist", "path"))
    try:
        path = p.path(("checklist", "path"), p.model.checklist.path)
        if not checklist.present(path):
            return []  # preflight's error
        text = checklist.read(path)
    except FatalError:
        return []  # preflight's error, or the template's
    found = []
    if checklist.next_todo(text) is None:
        counts = checklist.counts(text)
        said = f"{path}: nothing to do ({counts.done} done, {counts.skipped} skipped, 0 open)"
        said += "; the run will end at once: add '- [ ] item' lines"
        found.append(str(_at(at, said)))
    near = checklist.near_miss_warning(text)
    if near:
        found.append(str(_at(at, f"{path}: {near}")))
    if git.is_repo(p.workdir) and _uncommitted(p.workdir, path):
        said = f"{path} is not committed: commit it first (verify reads each tick from git)"
        found.append(str(_at(at, said)))
    return found


def _inside_workdir(p: plan.Plan) -> list[str]:
    """Variables named `*_dir` that point into the workdir where git does not ignore them:
    the agent's `git add -A` would commit a server's pid file and log (demo.yaml's
    `.standin` did). ralph-run's own files (.ralph/, the death log) are excluded by the run."""
    if not git.is_repo(p.workdir):
        return []
    workdir = p.workdir.resolve()
    try:  # the death log's folder: the run keeps its two files out of git itself
        death_log = p.path(("diagnostics", "log"), p.model.diagnostics.log).resolve().parent
    except FatalError:
        death_log = None
    found = []
    for name, value in p.variables.items():
        if not (isinstance(value, str) and name.endswith("_dir")):
            continue
        target = (p.workdir / os.path.expanduser(value)).resolve()
        if target == workdir or not target.is_relative_to(workdir):
            continue
        if target == death_log or _ignored(p.workdir, target):
            continue
        said = (
            f"variable {name!r}: {value} is inside the workdir and git does not ignore it: the"
            " agent's commits take it along; put it outside (e.g. ~/.local/state/...)"
        )
        found.append(str(_at(p.runbook.where(("vars", name)), said)))
    return found


def _uncommitted(workdir: Path, path: Path) -> bool:
    answer = _git(workdir, "status", "--porcelain", "--", str(path))
    return answer is not None and answer.strip() != ""


def _ignored(workdir: Path, folder: Path) -> bool:
    """Whether git ignores what the folder will hold (`name/` patterns match a folder only:
    asked of a file in it, the answer holds before the folder exists)."""
    return _git(workdir, "check-ignore", "-q", "--", str(folder / "x")) is not None


def _git(workdir: Path, *args: str) -> str | None:
    """A read-only git question's answer; None when git says no (or cannot say)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(workdir), *args],
            capture_output=True, text=True, timeout=GIT_TIMEOUT, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _at(where: Problem, message: str) -> Problem:
    return Problem(message, where.file, where.line, where.column, where.path)
