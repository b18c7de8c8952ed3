"""Issue 37, finding High 2, written as the attack: a repository that commits the link
`.ralph/worktrees -> ../../precious` (real git, a real link) must not turn the clean-up of
stale worktrees (`loop.workers` >= 2) into deleting every directory under `precious`.

- a run with workers 2 in such a repository refuses at its start (exit 2, `.ralph/` named as
  tracked) and `precious` stays whole; the same link planted, not committed: refused by the check
  of `.ralph/worktrees` itself, `precious` whole;
- workspace/worktrees.py on its own: `stale()` and `add()` with the link in place refuse and
  touch nothing outside; a `.ralph/worktrees` of another user is refused (as root), one of ours
  open to others is narrowed to 0700;
- a `.ralph/` that git tracks, with one worker: refused before `.ralph/` is written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from support.e2e import Scenario
from support.workers import git, prepare

from ralph_runner.errors import FatalError
from ralph_runner.workspace import git as workspace_git
from ralph_runner.workspace import worktrees

pytestmark = pytest.mark.timeout(120)

LINK = "../../precious"  # from <workdir>/.ralph/: the workdir's sibling `precious`


def plant(workdir: Path, *, commit: bool) -> Path:
    """`precious/keep/file` beside the workdir and the link `.ralph/worktrees` to it (committed,
    as a hostile repository ships it, or only planted). Returns the file."""
    keep = workdir.parent / "precious" / "keep"
    keep.mkdir(parents=True)
    (keep / "file").write_text("precious\n")
    (workdir / ".ralph").mkdir(exist_ok=True)
    (workdir / ".ralph" / "worktrees").symlink_to(LINK)
    if commit:
        git(workdir, "add", ".ralph/worktrees")
        git(workdir, "commit", "-qm", "a link where ralph-run cleans")
    return keep / "file"


def repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    (path / "CHECKLIST.md").write_text("- [ ] a\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "init")
    return path


# -- a real run -------------------------------------------------------------------------------


def test_a_committed_worktrees_link_is_refused_and_deletes_nothing(scenario: Scenario) -> None:
    prepare(scenario, ["ok 1", "ok 2"], workers=2)
    kept = plant(scenario.workspace, commit=True)
    run = scenario.start()
    code = run.wait()
    assert kept.read_text() == "precious\n"  # before: gone, with every directory beside it
    assert code == 2, run.stderr
    assert ".ralph" in run.stderr and "is tracked by git (.ralph/worktrees)" in run.stderr
    assert "Traceback" not in run.stderr
    assert scenario.marks() == [" ", " "]


def test_a_planted_worktrees_link_is_refused_and_deletes_nothing(scenario: Scenario) -> None:
    prepare(scenario, ["ok 1", "ok 2"], workers=2)
    kept = plant(scenario.workspace, commit=False)
    run = scenario.start()
    code = run.wait()
    assert kept.read_text() == "precious\n"  # before: gone, with every directory beside it
    assert code == 2, run.stderr
    where = scenario.workspace / ".ralph" / "worktrees"
    assert f"{where}: is a symlink to {LINK}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in kept.parent.parent.iterdir()) == ["keep"]  # no worktree there
    assert scenario.marks() == [" ", " "]


def test_a_tracked_ralph_directory_is_refused_before_it_is_written(scenario: Scenario) -> None:
    scenario.prepare(["one"])
    state = scenario.workspace / ".ralph"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    (state / "notes.txt").write_text("the repository's, not ralph-run's\n")
    git(scenario.workspace, "add", ".ralph/notes.txt")
    git(scenario.workspace, "commit", "-qm", "a tracked .ralph/")
    run = scenario.start()
    assert run.wait() == 2, run.stderr
    assert f"{state}: is tracked by git (.ralph/notes.txt)" in run.stderr, run.stderr
    assert sorted(p.name for p in state.iterdir()) == ["notes.txt"]  # no lock, no state.json
    assert stat.S_IMODE(state.stat().st_mode) == 0o755  # not even narrowed
    assert scenario.marks() == [" "]


# -- workspace/worktrees.py on its own --------------------------------------------------------


def test_stale_with_the_link_in_place_refuses_and_removes_nothing(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    kept = plant(top, commit=True)
    with pytest.raises(FatalError, match=r"is a symlink to \.\./\.\./precious") as raised:
        worktrees.stale(top)
    assert kept.read_text() == "precious\n"
    assert raised.value.exit_code == 2
    assert (top / ".ralph" / "worktrees").is_symlink()


def test_add_with_the_link_in_place_makes_nothing_outside(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    kept = plant(top, commit=False)
    with pytest.raises(FatalError, match="not a directory of ralph-run's own"):
        worktrees.add(top, 1, "a")
    assert sorted(p.name for p in kept.parent.parent.iterdir()) == ["keep"]
    assert kept.read_text() == "precious\n"
    assert len(git(top, "worktree", "list").splitlines()) == 1  # the workdir's only


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_a_worktrees_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    where = top / ".ralph" / "worktrees"
    (where / "1").mkdir(parents=True)
    (where / "1" / "theirs").write_text("theirs\n")
    os.chown(where, 54321, 54321)
    with pytest.raises(FatalError, match="belongs to uid 54321"):
        worktrees.stale(top)
    assert (where / "1" / "theirs").read_text() == "theirs\n"


def test_a_worktrees_directory_of_ours_is_kept_0700(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    where = top / ".ralph" / "worktrees"
    where.mkdir(parents=True)
    where.chmod(0o755)  # as an older ralph-run made it
    tree = worktrees.add(top, 1, "a")
    assert stat.S_IMODE(where.lstat().st_mode) == 0o700
    assert tree.path.is_dir()
    removed = worktrees.stale(top)
    assert tree.branch in removed and str(tree.path) in removed
    assert not any(where.iterdir())


def test_refuse_tracked_names_what_git_tracks(tmp_path: Path) -> None:
    top = repo(tmp_path / "w")
    workspace_git.refuse_tracked(top, [top / ".ralph"])  # nothing tracked: no error
    plant(top, commit=True)
    with pytest.raises(FatalError, match=r"is tracked by git \(\.ralph/worktrees\)") as raised:
        workspace_git.refuse_tracked(top, [top / ".ralph"])
    assert raised.value.exit_code == 2
