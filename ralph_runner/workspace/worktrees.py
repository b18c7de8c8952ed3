"""The git worktrees of `loop.workers` > 1: one per attempt, and the landing of its commits.

An attempt works in `.ralph/worktrees/<n>` on a branch `ralph/<item-slug>-<n>` from the head of
the workdir's branch, recorded in `.ralph/worktrees.json` before it is made: a rerun after a
kill -9 deletes the recorded branches only. Landing builds the whole landing in that worktree
(the attempt's commits replayed onto the workdir's head, the checklist left out, then the item
ticked) and moves the workdir's branch with one `merge --ff-only`: the operator's checkout moves
only by whole landings, and a landing that does not apply leaves the workdir as it was.

`.ralph/worktrees` is checked as `.ralph/` is (a real directory of ours, 0700) before anything is
made or removed under it, and removals go through its file descriptor without following a link:
a repository that commits `.ralph/worktrees -> ../../precious` must not turn the clean-up of
stale worktrees into deleting everything under `precious`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from ralph_runner.durable.files import PRIVATE_DIRECTORY, state_directory, write_atomic
from ralph_runner.errors import FatalError, Problem
from ralph_runner.process import execute
from ralph_runner.workspace import checklist
from ralph_runner.workspace.state_files import STATE_DIR

BRANCH_PREFIX = "ralph/"
WORKTREES = "worktrees"  # under .ralph/
RECORD = "worktrees.json"  # under .ralph/: the branches ralph-run made (Made)
GIT_TIMEOUT = 120
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


@contextlib.contextmanager
def opened_root(workdir: Path, *, create: bool) -> Iterator[int | None]:
    """`.ralph/worktrees` open, reached without following a link, and checked as `.ralph/` is:
    a directory of ours, 0700 (made so, or narrowed); None when it is missing and not `create`.
    FatalError (nothing touched) when it is a link, not a directory, or another user's: a link
    there would make the clean-up delete whatever it points to."""
    where, state = root(workdir), workdir / STATE_DIR
    if not create and not os.path.lexists(state):
        yield None  # nothing made yet: nothing to clean
        return
    state_directory(state)
    try:
        parent = os.open(state, _DIRECTORY)
    except OSError as e:
        raise FatalError(Problem(f"cannot open: {e.strerror}", str(state))) from None
    try:
        fd = _open_child(parent, where, create)
    finally:
        os.close(parent)
    if fd is None:
        yield None
        return
    try:
        _check_ours(fd, where)
        yield fd
    finally:
        os.close(fd)


def _open_child(parent: int, where: Path, create: bool) -> int | None:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(WORKTREES, PRIVATE_DIRECTORY, dir_fd=parent)
    try:
        info = os.lstat(WORKTREES, dir_fd=parent)
        if not stat.S_ISLNK(info.st_mode):
            return os.open(WORKTREES, _DIRECTORY, dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise FatalError(Problem(f"cannot open: {e.strerror}", str(where))) from None
    raise FatalError(Problem(_not_a_directory(parent), str(where)))


def _not_a_directory(parent: int) -> str:
    try:
        found = f"a symlink to {os.readlink(WORKTREES, dir_fd=parent)}"
    except OSError:
        found = "a file"
    return (
        f"is {found}, not a directory of ralph-run's own: refused, as removing stale worktrees "
        "would delete what it points to; remove it (`git rm` it where the repository tracks it)"
    )


def _check_ours(fd: int, where: Path) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.getuid():
        why = f"belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): refused"
        raise FatalError(Problem(why, str(where)))
    if stat.S_IMODE(info.st_mode) != PRIVATE_DIRECTORY:
        os.fchmod(fd, PRIVATE_DIRECTORY)


def _remove_entry(parent: int, name: str) -> None:
    """`name` in the directory open as `parent` gone, no link followed: a link or a file is
    unlinked (never what it points to), a directory removed through fds (rmtree's dir_fd)."""
    try:
        info = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, ignore_errors=True, dir_fd=parent)
    else:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent)


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
        _drop(workdir, path.name, branch if branch in made else None)
        _write_made(workdir, sorted({*_made(workdir), branch}))
    base = head(workdir)
    with opened_root(workdir, create=True):  # git makes the worktree in a checked directory
        _git(workdir, "worktree", "add", "-q", "-b", branch, str(path), base)
    return Tree(path, branch, base)


def remove(workdir: Path, tree: Tree) -> None:
    """The worktree and its branch gone (whatever state they are in), and its record."""
    with _record_lock:
        _drop(workdir, tree.path.name, tree.branch)
        _write_made(workdir, [b for b in _made(workdir) if b != tree.branch])


def _drop(workdir: Path, name: str, branch: str | None) -> None:
    """The worktree `.ralph/worktrees/<name>` gone (git's record of it, then what is left of
    its files, through the checked directory's fd), and `branch`."""
    with opened_root(workdir, create=False) as fd:
        path = root(workdir) / name
        _git(workdir, "worktree", "remove", "--force", "--force", str(path), check=False)
        if fd is not None:
            _remove_entry(fd, name)
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
    with opened_root(workdir, create=False) as fd:  # a link there: refused before any removal
        listed = _git(workdir, "worktree", "list", "--porcelain", check=False).output
        for line in listed.splitlines():
            if line.startswith("worktree "):
                path = Path(line.removeprefix("worktree "))
                if path.resolve().is_relative_to(where.resolve()):
                    _git(
                        workdir, "worktree", "remove", "--force", "--force", str(path), check=False
                    )
                    found.append(str(path))
        if fd is not None:
            for name in os.listdir(fd):
                _remove_entry(fd, name)
                found.append(str(where / name))
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
