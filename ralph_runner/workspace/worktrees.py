"""The git worktrees of `loop.workers` > 1: one per attempt, and the landing of its commits.

An attempt works in `.ralph/worktrees/<n>` on a branch `ralph/<item-slug>-<n>` from the head of
the workdir's branch, recorded in `.ralph/worktrees.json` before it is made: a rerun after a
kill -9 deletes the recorded branches only. Landing builds the whole landing in that worktree
(the attempt's commits replayed onto the workdir's head, the checklist left out, then the item
ticked) and moves the workdir's branch with one `merge --ff-only`: the operator's checkout moves
only by whole landings, and a landing that does not apply leaves the workdir as it was.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from ralph_runner.durable.files import state_directory, write_atomic
from ralph_runner.process import execute
from ralph_runner.workspace import checklist
from ralph_runner.workspace.state_files import STATE_DIR

BRANCH_PREFIX = "ralph/"
WORKTREES = "worktrees"  # under .ralph/
RECORD = "worktrees.json"  # under .ralph/: the branches ralph-run made (Made)
GIT_TIMEOUT = 120


_record_lock = threading.Lock()  # the record's read-modify-write, between workers


class Made(TypedDict):
    """`.ralph/worktrees.json`: the branches made and not yet removed; the stale clean-up
    after a kill -9 deletes these and no other (an operator's `ralph/mine` stays)."""

    branches: list[str]


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
    """A fresh worktree for `worker` on a new branch from the workdir's head. Its branch and
    path are recorded (.ralph/worktrees.json) before git makes them, so that a kill -9 at any
    point leaves nothing of ours unrecorded; a branch of that name that is not ours is left
    alone and another name taken."""
    path = root(workdir) / str(worker)
    with _record_lock:
        made = _made(workdir)
        name = f"{BRANCH_PREFIX}{slug(item_text)}-{worker}"
        branch, n = name, 1
        while branch not in made and _branch_exists(workdir, branch):
            n += 1
            branch = f"{name}-{n}"
        _drop(workdir, path, branch if branch in made else None)
        _write_made(workdir, sorted({*_made(workdir), branch}))
    base = head(workdir)
    path.parent.mkdir(parents=True, exist_ok=True)
    _git(workdir, "worktree", "add", "-q", "-b", branch, str(path), base)
    return Tree(path, branch, base)


def remove(workdir: Path, tree: Tree) -> None:
    """The worktree and its branch gone (whatever state they are in), and its record."""
    with _record_lock:
        _drop(workdir, tree.path, tree.branch)
        _write_made(workdir, [b for b in _made(workdir) if b != tree.branch])


def _drop(workdir: Path, path: Path, branch: str | None) -> None:
    _git(workdir, "worktree", "remove", "--force", "--force", str(path), check=False)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    _git(workdir, "worktree", "prune", check=False)
    if branch:
        _git(workdir, "branch", "-D", "-q", branch, check=False)


def _branch_exists(workdir: Path, branch: str) -> bool:
    return _git(workdir, "rev-parse", "-q", "--verify", f"refs/heads/{branch}", check=False).ok


def record_path(workdir: Path) -> Path:
    """The branches ralph-run made and has not removed yet: `.ralph/worktrees.json`."""
    return workdir / STATE_DIR / RECORD


def _made(workdir: Path) -> list[str]:
    try:
        loaded = json.loads(record_path(workdir).read_text())
    except (OSError, ValueError):
        return []  # none made yet (or a torn file: write_atomic makes none)
    branches = loaded.get("branches") if isinstance(loaded, dict) else None
    return [b for b in branches if isinstance(b, str)] if isinstance(branches, list) else []


def _write_made(workdir: Path, branches: list[str]) -> None:
    state_directory(workdir / STATE_DIR)
    record: Made = {"branches": branches}
    write_atomic(record_path(workdir), json.dumps(record).encode(), follow=False)


def stale(workdir: Path) -> list[str]:
    """Clean what a run killed with -9 left: every worktree under `.ralph/worktrees` (ralph-run's
    own directory) and the branches recorded as made by ralph-run, never another `ralph/*`
    branch (nothing of them had landed: a landing is one fast-forward). Returns what was
    removed, for the operator."""
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
    with _record_lock:
        for branch in _made(workdir):
            if _branch_exists(workdir, branch):
                _git(workdir, "branch", "-D", "-q", branch, check=False)
                found.append(branch)
        if record_path(workdir).exists():
            _write_made(workdir, [])
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
