"""The few git facts the loop needs, asked through the one process module, and the excludes
that keep ralph-run's own files out of `git status`."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ralph_runner.durable.files import TEMP_SUFFIX
from ralph_runner.errors import FatalError, Problem
from ralph_runner.process import execute
from ralph_runner.workspace.state_files import STATE_DIR

EXCLUDE_HEADER = "# ralph-run's own files (state, temp files, death logs)"


@dataclass(frozen=True)
class Snapshot:
    """HEAD and the work tree's changes, from one `git status` (one process, not two)."""

    head: str | None  # None: no commit yet
    changes: tuple[tuple[str, str], ...]  # (status code, path from the top), sorted
    # (path, mtime_ns, size) of each changed path: a file that was dirty already and is
    # written again changes no status code, but changes its stamp
    stamps: tuple[tuple[str, int, int], ...] = ()

    def without(self, housekeeping) -> Snapshot:
        """The snapshot with the changes `housekeeping(code, path)` accepts left out."""
        kept = tuple(c for c in self.changes if not housekeeping(*c))
        paths = {path for _, path in kept}
        return Snapshot(self.head, kept, tuple(s for s in self.stamps if s[0] in paths))

    @property
    def clean(self) -> bool:
        return not self.changes


_FIELDS_BEFORE_PATH = {"1": 7, "2": 8, "u": 9}  # porcelain v2: fields after the kind, then the path
_STATUS_OUTPUT = 8 * 1024 * 1024  # the header comes first: the output must not lose its start


def _git(workdir: Path, *args: str, check: bool = True) -> str:
    result = execute.run(["git", *args], cwd=workdir, timeout=60)
    if check and not result.ok:
        raise FatalError(f"git {' '.join(args)} failed in {workdir}: {result.output.strip()}")
    return result.output.strip()


def head(workdir: Path) -> str | None:
    """The commit HEAD points at, or None in a repository with no commit yet."""
    result = execute.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=workdir, timeout=60)
    return result.output.strip() if result.ok else None


def snapshot(workdir: Path) -> Snapshot:
    """HEAD and every changed or untracked path (ignored files left out), NUL-separated so that
    any file name parses."""
    result = execute.run(
        ["git", "status", "--porcelain=v2", "--branch", "-z"],
        cwd=workdir,
        timeout=60,
        max_output=_STATUS_OUTPUT,
    )
    if not result.ok:
        raise FatalError(f"git status failed in {workdir}: {result.output.strip()}")
    head, changes = None, []
    fields = iter(result.output.split("\0"))
    for entry in fields:
        kind, _, rest = entry.partition(" ")
        if kind == "#" and rest.startswith("branch.oid "):
            oid = rest.split()[1]
            head = None if oid == "(initial)" else oid
        elif kind in _FIELDS_BEFORE_PATH:
            parts = rest.split(" ", _FIELDS_BEFORE_PATH[kind])
            changes.append((parts[0], parts[-1]))
            if kind == "2":
                next(fields, None)  # a rename's original path
        elif kind == "?":
            changes.append(("??", rest))
    root = top(workdir)
    return Snapshot(head, tuple(sorted(changes)), tuple(_stamp(root, p) for _, p in changes))


def top(workdir: Path) -> Path:
    """The work tree's top directory (git's paths start there), without running git."""
    start = Path(workdir).resolve()
    for directory in [start, *start.parents]:
        if (directory / ".git").exists():
            return directory
    return start


def _stamp(root: Path, path: str) -> tuple[str, int, int]:
    try:
        info = (root / path).lstat()
    except OSError:
        return (path, -1, -1)  # deleted
    return (path, info.st_mtime_ns, info.st_size)


def show(workdir: Path, revision: str, path: str) -> str | None:
    """The content of `path` (from the top) at `revision`, or None where it has none."""
    result = execute.run(["git", "show", f"{revision}:{path}"], cwd=workdir, timeout=60)
    return result.output if result.ok else None


def commit_paths(workdir: Path, message: str, *paths: Path) -> None:
    """Commit just these paths: a skip commit must not sweep up an agent's half-done work."""
    names = [str(p) for p in paths]
    _git(workdir, "add", "--", *names)
    _git(workdir, "commit", "-q", "--no-verify", "-m", message, "--", *names)


def is_repo(workdir: Path) -> bool:
    return execute.run(["git", "rev-parse", "--git-dir"], cwd=workdir, timeout=60).ok


def exclude_from_git(workdir: Path, paths: list[Path], patterns: Iterable[str] = ()) -> None:
    """Keep ralph-run's files out of `git status` via .git/info/exclude, so `verify: committed`
    never sees them as a dirty tree. `.ralph/` and leftover temp files always; `paths` (relative
    to `workdir` or absolute) when they lie inside the repository; `patterns` (gitignore
    patterns: the agents' own files) as they are. Adds each entry once; does nothing outside a
    git repository.
    """
    workdir = Path(os.path.realpath(workdir))
    found = _find_repo(workdir)
    if found is None:
        return
    top, common_dir = found
    wanted = [f"*{TEMP_SUFFIX}", _anchored(top, workdir / STATE_DIR) + "/"]
    for path in paths:
        absolute = Path(os.path.realpath(workdir / path))
        if absolute.is_relative_to(top) and absolute != top:
            wanted.append(_anchored(top, absolute))
    wanted.extend(patterns)
    exclude = common_dir / "info" / "exclude"
    existing = exclude.read_text("utf-8", "replace") if exclude.exists() else ""
    present = existing.split("\n")
    missing = [e for e in dict.fromkeys(wanted) if e not in present]
    if not missing:
        return
    lines = [EXCLUDE_HEADER] if EXCLUDE_HEADER not in present else []
    exclude.parent.mkdir(parents=True, exist_ok=True)
    separator = "\n" if existing and not existing.endswith("\n") else ""
    with exclude.open("a", encoding="utf-8") as out:
        out.write(separator + "".join(f"{line}\n" for line in [*lines, *missing]))


def refuse_tracked(workdir: Path, directories: Iterable[Path]) -> None:
    """FatalError (exit 2) when the repository tracks anything under one of ralph-run's own
    `directories` (`.ralph/`): what a repository commits there is the repository's, not ours,
    and a committed link (`.ralph/worktrees -> ../../x`) would turn a clean-up into deleting
    what it points to. Nothing is checked outside a git repository."""
    here = os.path.realpath(workdir)  # git's paths are real ones; `.ralph` itself may be a link
    for directory in dict.fromkeys(Path(os.path.realpath(d.parent)) / d.name for d in directories):
        spec = os.path.relpath(directory, here)
        argv = ["git", "--literal-pathspecs", "ls-files", "-z", "--full-name", "--", spec]
        result = execute.run(argv, cwd=here, timeout=60)
        tracked = [p for p in result.output.split("\0") if p] if result.ok else []
        if tracked:
            more = len(tracked) - 3
            shown = ", ".join(tracked[:3]) + (f" and {more} more" if more > 0 else "")
            why = (
                f"is tracked by git ({shown}): ralph-run's own directory must not be the "
                "repository's; `git rm -r --cached` it and commit, then run again"
            )
            raise FatalError(Problem(why, str(directory)))


def _find_repo(start: Path) -> tuple[Path, Path] | None:
    """(work tree top, common git dir) of the repository holding `start`, without running git.

    A `.git` file (worktree, submodule) points at the git dir; a worktree's `commondir` points
    at the directory that holds `info/exclude`.
    """
    for directory in [start, *start.parents]:
        dotgit = directory / ".git"
        if dotgit.is_dir():
            return directory, dotgit
        if dotgit.is_file():
            content = dotgit.read_text(encoding="utf-8").strip()
            if not content.startswith("gitdir:"):
                return None
            git_dir = (directory / content.removeprefix("gitdir:").strip()).resolve()
            commondir = git_dir / "commondir"
            if commondir.is_file():
                git_dir = (git_dir / commondir.read_text(encoding="utf-8").strip()).resolve()
            return directory, git_dir
    return None


def _anchored(top: Path, path: Path) -> str:
    """A gitignore pattern that matches exactly `path` (inside `top`) and nothing else."""
    escaped = "".join("\\" + c if c in "\\*?[" else c for c in path.relative_to(top).as_posix())
    if escaped.endswith(" "):  # git strips unescaped trailing spaces
        escaped = escaped[:-1] + "\\ "
    return "/" + escaped
