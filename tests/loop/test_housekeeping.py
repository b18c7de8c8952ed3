"""Agent housekeeping is no strike: the files an agent writes for itself (aider's `.aider*`
files and its `.gitignore` edit) never make finished work "uncommitted changes", while any
other change an agent leaves uncommitted still does.

The agent is a bash script doing exactly what aider 0.86 does to a repository (aider/main.py,
check_gitignore, and its history files); branch `agents` runs the real aider.
"""

from __future__ import annotations

import uuid

import pytest
from test_loop import Loop, events, git, of_kind

from ralph_runner.loop import housekeeping

pytestmark = pytest.mark.timeout(60)

# aider's check_gitignore: if `.aider` and `.env` are both ignored already, nothing; else
# `.aider*` is appended when it is not a line of .gitignore yet, `.env` when a .env exists (or
# both when there is no .gitignore at all), without a commit. Then its own files, the edit,
# and a commit of the edited files only.
AIDER = r"""#!/bin/bash
item=$1
if ! { git check-ignore -q .aider && git check-ignore -q .env; }; then
  if [ -f .gitignore ]; then
    add=()
    grep -qxF '.aider*' .gitignore || add+=('.aider*')
    { ! grep -qxF '.env' .gitignore && [ -e .env ]; } && add+=('.env')
    if [ ${#add[@]} -gt 0 ]; then
      [ -s .gitignore ] && [ "$(tail -c1 .gitignore)" != "" ] && echo >> .gitignore
      printf '%s\n' "${add[@]}" >> .gitignore
    fi
  else
    printf '.aider*\n.env\n' > .gitignore
  fi
fi
printf '# aider chat started\n\n#### %s\n' "$item" >> .aider.chat.history.md
printf '\n# %s\n+%s\n' "$(date)" "$item" >> .aider.input.history
mkdir -p .aider.tags.cache.v4 && echo cache > .aider.tags.cache.v4/cache.db
echo "$item" >> work.txt
sed -i '0,/^- \[ \] /s//- [x] /' CHECKLIST.md
git add work.txt
git commit -q -m "feat: $item" -- CHECKLIST.md work.txt
[ -n "$EXTRA" ] && eval "$EXTRA"
exit 0
"""


@pytest.fixture
def loop(tmp_path):
    workspace = Loop(tmp_path, f"m{uuid.uuid4().hex[:12]}")
    yield workspace
    assert workspace.close() == [], "a test left agent processes behind"


def aider_loop(loop: Loop, gitignore: str | None, extra: str = "", **verify) -> Loop:
    agent = loop.root / "agent.sh"
    agent.write_text(AIDER)
    agent.chmod(0o755)
    loop.setup(
        ["first item", "second item"],
        checklist={"path": "CHECKLIST.md", "strikes": 1},
        loop={
            "steps": [
                {"name": "aider", "shell": "{{ agent }} {{ item.text }}", "env": {"EXTRA": extra}},
                {"verify": {"checked": True, "committed": True, **verify}},
            ]
        },
    )
    if gitignore is not None:
        (loop.work / ".gitignore").write_text(gitignore)
        git(loop.work, "add", ".gitignore")
        git(loop.work, "commit", "-qm", "gitignore")
    return loop


def test_aiders_files_and_gitignore_edit_are_no_uncommitted_changes(loop):
    aider_loop(loop, "*.pyc\n__pycache__/")  # no final newline: aider adds one first
    done = loop.run()
    assert done.returncode == 0, done.stderr
    assert not of_kind(events(done.stdout), "strike")
    assert loop.checklist().count("- [x] ") == 2
    assert (loop.work / ".gitignore").read_text() == "*.pyc\n__pycache__/\n.aider*\n"
    assert git(loop.work, "status", "--porcelain") == " M .gitignore\n"  # left for the operator
    assert ".aider*" in (loop.work / ".git" / "info" / "exclude").read_text().splitlines()
    # the agent's own files were never committed, even by `git add -A`
    assert not [p for p in git(loop.work, "ls-files").split() if p.startswith(".aider")]


def test_a_gitignore_aider_creates_is_housekeeping_too(loop):
    aider_loop(loop, None)
    done = loop.run()
    assert done.returncode == 0, done.stderr
    assert not of_kind(events(done.stdout), "strike")
    assert (loop.work / ".gitignore").read_text() == ".aider*\n.env\n"
    assert git(loop.work, "status", "--porcelain") == "?? .gitignore\n"


def test_other_gitignore_changes_left_uncommitted_are_struck(loop):
    aider_loop(loop, "*.pyc\n", extra="echo 'build/' >> .gitignore")
    done = loop.run()
    assert done.returncode == 0, done.stderr
    reasons = [s["reason"] for s in of_kind(events(done.stdout), "strike")]
    assert reasons == ["verify: uncommitted changes"] * 2


def test_a_gitignore_line_removed_is_work_not_housekeeping(loop):
    aider_loop(loop, "*.pyc\n.aider*\n", extra="sed -i '/pyc/d' .gitignore")
    done = loop.run()
    assert [s["reason"] for s in of_kind(events(done.stdout), "strike")] == [
        "verify: uncommitted changes"
    ] * 2


def test_verify_ignore_adds_an_agents_own_files(loop):
    extra = "mkdir -p .agent-notes && date > .agent-notes/log"
    aider_loop(loop, ".aider*\n", extra=extra, ignore=[".agent-notes/"])
    done = loop.run()
    assert done.returncode == 0, done.stderr
    assert not of_kind(events(done.stdout), "strike")
    exclude = (loop.work / ".git" / "info" / "exclude").read_text().splitlines()
    assert ".agent-notes/" in exclude and ".aider*" in exclude


def test_a_tracked_agent_file_modified_is_housekeeping(loop):
    aider_loop(loop, ".env\n")
    (loop.work / ".aider.chat.history.md").write_text("# old history, committed once\n")
    git(loop.work, "add", "-f", ".aider.chat.history.md")
    git(loop.work, "commit", "-qm", "history")
    done = loop.run()
    assert done.returncode == 0, done.stderr
    assert not of_kind(events(done.stdout), "strike")
    assert " M .aider.chat.history.md" in git(loop.work, "status", "--porcelain")


# -- the rules on their own --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (".aider.chat.history.md", True),
        (".aider.tags.cache.v4/", True),
        ("sub/.aider.input.history", True),
        ("aider.py", False),
        ("src/main.py", False),
    ],
)
def test_default_patterns_match_aiders_files_only(path, expected):
    assert housekeeping.matches(path, housekeeping.DEFAULT_IGNORE) is expected


def test_anchored_patterns_match_from_the_top():
    assert housekeeping.matches("build/out/x.o", ["build/out"])
    assert not housekeeping.matches("src/build/out", ["/build/out"])


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ("*.pyc", "*.pyc\n.aider*\n", True),
        ("*.pyc\n", "*.pyc\n\n# aider\n.aider*\n.env\n", True),
        (None, ".aider*\n.env\n", True),
        ("*.pyc\n", "*.pyc\nbuild/\n", False),
        ("*.pyc\n.env\n", ".aider*\n", False),  # lines removed
        ("*.pyc\n", "*.pyo\n.aider*\n", False),  # a line changed
    ],
)
def test_a_gitignore_edit_is_housekeeping_only_when_it_only_adds_agent_lines(
    before, after, expected
):
    assert housekeeping.only_adds_agent_lines(before, after, [".aider*"]) is expected
