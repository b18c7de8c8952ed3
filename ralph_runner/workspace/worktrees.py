"""The git worktrees of `loop.workers` > 1: one per attempt, and the landing of its commits.

An attempt works in `.ralph/worktrees/<n>` on a branch `ralph/<item-slug>-<n>` from the head of
the workdir's branch. Landing builds the whole landing in that worktree (the attempt's commits
replayed onto the workdir's head, the checklist left out, then the item ticked) and moves the
workdir's branch with one `merge --ff-only`: the operator's checkout moves only by whole
landings, and a landing that does not apply leaves the workdir as it was.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ralph_runner.process import execute
from ralph_runner.workspace import checklist
from ralph_runner.workspace.state_files import STATE_DIR

BRANCH_PREFIX = "ralph/"
WORKTREES = "worktrees"  # under .ralph/
GIT_TIMEOUT = 120


class GitFailed(RuntimeError):
    """A git command that must not fail did."""


def _git(cwd: Path, *args: str, check: bool = True) -> execute.Result:
    result = execute.run(["git", *args], cwd=cwd, timeout=GIT_TIMEOUT)
    if check and not result.ok:
        raise GitFailed(f"git {' '.join(args)} failed in {cwd}: {result.output.strip()}")
    return result


def root(workdir: Path) -> Path:
    """Where the workers' worktrees live: the workdir's `.ralph/worktrees`."""
    return workdir / STATE_DIR / WORKTREES


def slug(text: str, most: int = 40) -> str:
    """An item's text as a branch name's part: lower case, words joined by '-'."""
    words = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return words[:most].rstrip("-") or "item"


def head(workdir: Path) -> str:
    return _git(workdir, "rev-parse", "HEAD").output.strip()


@dataclass(frozen=True)
class Tree:
    """One attempt's worktree: its root, its branch, the head it started from."""

    path: Path
    branch: str
    base: str


def add(workdir: Path, worker: int, item_text: str) -> Tree:
    """A fresh worktree for `worker` on a new branch from the workdir's head."""
    path = root(workdir) / str(worker)
    branch = f"{BRANCH_PREFIX}{slug(item_text)}-{worker}"
    _drop(workdir, path, branch)
    base = head(workdir)
    path.parent.mkdir(parents=True, exist_ok=True)
    _git(workdir, "worktree", "add", "-q", "-b", branch, str(path), base)
    return Tree(path, branch, base)


def remove(workdir: Path, tree: Tree) -> None:
    """The worktree and its branch gone (whatever state they are in)."""
    _drop(workdir, tree.path, tree.branch)


def _drop(workdir: Path, path: Path, branch: str | None) -> None:
    _git(workdir, "worktree", "remove", "--force", "--force", str(path), check=False)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    _git(workdir, "worktree", "prune", check=False)
    if branch:
        _git(workdir, "branch", "-D", "-q", branch, check=False)


def stale(workdir: Path) -> list[str]:
    """Clean what a run killed with -9 left: every worktree under `.ralph/worktrees` and every
    `ralph/*` branch (nothing of them had landed: a landing is one fast-forward). Returns what
    was removed, for the operator."""
    found: list[str] = []
    where = root(workdir)
    listed = _git(workdir, "worktree", "list", "--porcelain", check=False).output
    for line in listed.splitlines():
        if line.startswith("worktree "):
            path = Path(line.removeprefix("worktree "))
            if path.resolve().is_relative_to(where.resolve()):
                _drop(workdir, path, None)
                found.append(str(path))
    if where.exists():
        for child in where.iterdir():
            shutil.rmtree(child, ignore_errors=True)
            found.append(str(child))
    _git(workdir, "worktree", "prune", check=False)
    refs = _git(workdir, "for-each-ref", "--format=%(refname:short)", f"refs/heads/{BRANCH_PREFIX}")
    for branch in refs.output.split():
        _git(workdir, "branch", "-D", "-q", branch, check=False)
        found.append(branch)
    return sorted(set(found))


@dataclass(frozen=True)
class Landing:
    """What a landing did: the new head, or why it did not apply (`head` None)."""

    head: str | None
    commits: int
    reason: str = ""


def land(workdir: Path, tree: Tree, checklist_rel: str, item_text: str) -> Landing:
    """Replay the attempt's commits (the checklist left out) onto the workdir's head in the
    attempt's worktree, tick the item there and commit, then fast-forward the workdir's branch.
    A replay that conflicts, or a workdir that refuses the fast-forward (its branch moved by
    someone else, or its files in the way), leaves the workdir untouched."""
    wt = tree.path
    attempt_head = head(wt)
    commits = _git(wt, "rev-list", "--reverse", "--no-merges", f"{tree.base}..{attempt_head}")
    target = head(workdir)
    _git(wt, "reset", "-q", "--hard", target)
    replayed = 0
    with tempfile.TemporaryDirectory(prefix="ralph-land-") as scratch:
        patch = Path(scratch) / "commit.patch"
        for commit in commits.output.split():
            _git(
                wt,
                "diff",
                "--binary",
                f"--output={patch}",
                f"{commit}^",
                commit,
                "--",
                ".",
                f":(top,exclude){checklist_rel}",
            )
            if not patch.read_bytes().strip():
                continue  # it only ticked the checklist
            applied = _git(wt, "apply", "--3way", "--index", str(patch), check=False)
            if not applied.ok:
                _git(wt, "reset", "-q", "--hard", check=False)
                return Landing(None, replayed, _conflict_reason(applied.output))
            _git(wt, "commit", "-q", "--no-verify", "-C", commit)
            replayed += 1
    path = wt / checklist_rel
    text = checklist.read(path)
    item = checklist.find(text, item_text)
    if item is not None and item.mark != checklist.DONE:
        checklist.write(path, checklist.mark(text, item, checklist.DONE))
        _git(wt, "add", "--", checklist_rel)
        _git(wt, "commit", "-q", "--no-verify", "-m", f"ralph-run: done: {item_text}")
    landed = head(wt)
    merged = _git(workdir, "merge", "--ff-only", "-q", landed, check=False)
    if not merged.ok:
        return Landing(None, replayed, "the workdir refused the fast-forward: " + _last(merged))
    return Landing(landed, replayed)


def _conflict_reason(output: str) -> str:
    lines = [line for line in output.splitlines() if "conflict" in line.lower()]
    return (lines[0] if lines else _last_text(output)).strip()[:200]


def _last(result: execute.Result) -> str:
    return _last_text(result.output)


def _last_text(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "git said nothing"
