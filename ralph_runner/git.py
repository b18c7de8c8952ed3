"""The few git facts the loop needs, asked through the one process module."""

from __future__ import annotations

from pathlib import Path

from ralph_runner import execute
from ralph_runner.errors import FatalError


def _git(workdir: Path, *args: str, check: bool = True) -> str:
    result = execute.run(["git", *args], cwd=workdir, timeout=60)
    if check and not result.ok:
        raise FatalError(f"git {' '.join(args)} failed in {workdir}: {result.output.strip()}")
    return result.output.strip()


def head(workdir: Path) -> str | None:
    """The commit HEAD points at, or None in a repository with no commit yet."""
    result = execute.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=workdir, timeout=60)
    return result.output.strip() if result.ok else None


def head_and_clean(workdir: Path) -> tuple[str | None, bool]:
    """HEAD and whether the work tree is clean, from one `git status` (one process, not two)."""
    head, clean = None, True
    for line in _git(workdir, "status", "--porcelain=v2", "--branch").splitlines():
        if line.startswith("# branch.oid "):
            oid = line.split()[2]
            head = None if oid == "(initial)" else oid
        elif not line.startswith("#"):
            clean = False
    return head, clean


def commit_paths(workdir: Path, message: str, *paths: Path) -> None:
    """Commit just these paths: a skip commit must not sweep up an agent's half-done work."""
    names = [str(p) for p in paths]
    _git(workdir, "add", "--", *names)
    _git(workdir, "commit", "-q", "--no-verify", "-m", message, "--", *names)


def is_repo(workdir: Path) -> bool:
    return execute.run(["git", "rev-parse", "--git-dir"], cwd=workdir, timeout=60).ok
