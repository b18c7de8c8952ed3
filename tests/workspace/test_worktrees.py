"""workspace/worktrees.py on real git: an attempt's worktree, its landing, a conflict that
leaves the workdir as it was, and what a killed run left cleaned."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ralph_runner.workspace import worktrees


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    (path / ".git" / "info" / "exclude").write_text(".ralph/\n")  # as the run excludes it
    (path / "CHECKLIST.md").write_text("- [ ] a\n- [ ] b\n")
    (path / "shared.txt").write_text("base\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "init")
    return path


def work(tree: worktrees.Tree, item: str, shared: str | None = None) -> None:
    """What an agent does in its worktree: a file, maybe the shared line, the tick, a commit."""
    (tree.path / f"{item}.txt").write_text(item + "\n")
    if shared is not None:
        (tree.path / "shared.txt").write_text(shared + "\n")
    checklist = tree.path / "CHECKLIST.md"
    checklist.write_text(checklist.read_text().replace(f"- [ ] {item}", f"- [x] {item}"))
    git(tree.path, "add", "-A")
    git(tree.path, "commit", "-qm", f"work: {item}")


def test_two_attempts_land_with_their_ticks_and_no_checklist_conflict(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    a, b = worktrees.add(top, 1, "a"), worktrees.add(top, 2, "b")
    assert a.branch == "ralph/a-1" and a.path == top / ".ralph" / "worktrees" / "1"
    work(a, "a")
    work(b, "b")  # its tick is on the line next to a's: a merge would conflict
    first = worktrees.land(top, a, "CHECKLIST.md", "a")
    second = worktrees.land(top, b, "CHECKLIST.md", "b")
    assert first.head and second.head and second.commits == 1
    assert (top / "CHECKLIST.md").read_text() == "- [x] a\n- [x] b\n"
    assert git(top, "rev-parse", "HEAD") == second.head
    subjects = git(top, "log", "--format=%s").splitlines()
    assert subjects[:4] == ["ralph-run: done: b", "work: b", "ralph-run: done: a", "work: a"]
    assert git(top, "status", "--porcelain") == ""


def test_a_conflicting_landing_leaves_the_workdir_as_it_was(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    a, b = worktrees.add(top, 1, "a"), worktrees.add(top, 2, "b")
    work(a, "a", shared="from a")
    work(b, "b", shared="from b")
    assert worktrees.land(top, a, "CHECKLIST.md", "a").head
    head = git(top, "rev-parse", "HEAD")
    landing = worktrees.land(top, b, "CHECKLIST.md", "b")
    assert landing.head is None and landing.reason
    assert git(top, "rev-parse", "HEAD") == head
    assert (top / "shared.txt").read_text() == "from a\n"
    assert git(top, "status", "--porcelain") == ""


def test_what_a_killed_run_left_is_removed(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    for n, item in enumerate(["a", "b"], 1):
        work(worktrees.add(top, n, item), item)
    removed = worktrees.stale(top)
    assert "ralph/a-1" in removed and "ralph/b-2" in removed
    assert git(top, "branch", "--list", "ralph/*") == ""
    assert git(top, "worktree", "list").count("\n") == 0
    assert not any((top / ".ralph" / "worktrees").iterdir())


def test_the_clean_up_removes_only_the_branches_ralph_run_made(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    git(top, "branch", "ralph/mine")  # the operator's, of ralph-run's prefix
    git(top, "branch", "ralph/a-1")  # the operator's, of the very name worker 1 would take
    tree = worktrees.add(top, 1, "a")
    assert tree.branch == "ralph/a-1-2"
    work(tree, "a")
    made = worktrees.add(top, 2, "b")  # as a kill -9 leaves them: worktrees, branches, record
    assert worktrees.stale(top) == sorted(["ralph/a-1-2", "ralph/b-2", str(tree.path),
                                           str(made.path)])  # fmt: skip
    assert git(top, "branch", "--list", "ralph/*").split() == ["ralph/a-1", "ralph/mine"]
    assert worktrees.stale(top) == []  # the record is empty now
    again = worktrees.add(top, 1, "a")  # a rerun: the operator's ralph/a-1 is still not ours
    worktrees.remove(top, again)
    assert git(top, "branch", "--list", "ralph/*").split() == ["ralph/a-1", "ralph/mine"]
