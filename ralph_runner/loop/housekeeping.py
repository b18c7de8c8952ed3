"""Files coding agents write for themselves: never "uncommitted changes", never "work done".

Where each agent writes (in the repository; everything else goes under the home directory):

- aider: `.aider.chat.history.md`, `.aider.input.history`, `.aider.tags.cache.v*/`, and, unless
  `.aider` and `.env` are already ignored, it appends `.aider*` (and `.env`, when there is one
  or no .gitignore at all) to the top `.gitignore` without committing it.
- opencode: its project id in `.git/opencode`, inside the git directory: git never shows it.
- codex: nothing in the repository (`~/.codex/`).

The policy: paths matching `DEFAULT_IGNORE` plus a verify step's `ignore:` patterns are left out
of verify's view of the work tree, and ralph-run writes those patterns to `.git/info/exclude`
(so an agent's `git add -A` does not commit them either). A change to the top `.gitignore` that
only *adds* lines, each blank, a comment, one of those patterns or `.env`, is housekeeping too;
any other change to it (a removed line, a new rule for the project's files) is work, and must
be committed like any other.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable
from pathlib import Path

from ralph_runner.workspace import git

DEFAULT_IGNORE = (".aider*",)
GITIGNORE = ".gitignore"
GITIGNORE_EXTRA_LINES = (".env",)  # aider adds it next to `.aider*`


def matches(path: str, patterns: Iterable[str]) -> bool:
    """gitignore-like: a pattern with no inner `/` matches any path component (`.aider*`
    matches `.aider.tags.cache.v4/` and `sub/.aider.chat.history.md`); one with a `/` matches
    from the top (`build/out` matches `build/out` and what is under it)."""
    parts = path.rstrip("/").split("/")
    for pattern in patterns:
        bare = pattern.rstrip("/")
        if "/" in bare:
            bare = bare.lstrip("/")
            prefixes = ("/".join(parts[: n + 1]) for n in range(len(parts)))
            if any(fnmatch.fnmatchcase(prefix, bare) for prefix in prefixes):
                return True
        elif any(fnmatch.fnmatchcase(part, bare) for part in parts):
            return True
    return False


def only_adds_agent_lines(before: str | None, after: str, patterns: Iterable[str]) -> bool:
    """A .gitignore edit that only appends or inserts lines ignoring agent files."""
    allowed = {*patterns, *GITIGNORE_EXTRA_LINES}
    old, new = (before or "").splitlines(), after.splitlines()
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            return False
        for line in new[j1:j2]:
            stripped = line.strip()
            if stripped and not stripped.startswith("#") and stripped not in allowed:
                return False
    return True


def filter_for(workdir: Path, patterns: Iterable[str]) -> Callable[[str, str], bool]:
    """`(status code, path) -> is housekeeping` for git.Snapshot.without."""
    patterns = tuple(patterns)

    def housekeeping(code: str, path: str) -> bool:
        if matches(path, patterns):
            return True
        if path != GITIGNORE or "D" in code:
            return False
        before = None if code == "??" else git.show(workdir, "HEAD", GITIGNORE)
        try:
            after = (git.top(workdir) / GITIGNORE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return False
        return only_adds_agent_lines(before, after, patterns)

    return housekeeping
