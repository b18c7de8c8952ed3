"""The console's colour, as the terminal and the environment ask: a real `ralph-run` under a
pseudo-terminal (colour on), with `NO_COLOR` (none), and in a pipe with `FORCE_COLOR` (on)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.standin import python_env

pytestmark = pytest.mark.timeout(60)

SGR = re.compile(r"\x1b\[[0-9;]*m")  # a colour or weight escape (the ticker's erase is not one)
RUNBOOK = """
name: colour
workdir: "{{ runbook_dir }}/work"
checklist: { path: CHECKLIST.md }
prompt: "{{ item.text }}"
loop:
  steps:
    - name: agent
      shell: sed -i 's/^- \\[ \\] /- [x] /' CHECKLIST.md
    - verify: { checked: true, committed: false }
"""


def runbook(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "CHECKLIST.md").write_text("- [ ] the one item\n")
    path = tmp_path / "runbook.yaml"
    path.write_text(RUNBOOK)
    return path


def environment(**env: str) -> dict[str, str]:
    """This checkout's environment without the caller's own colour settings, plus `env`."""
    inherited = {k: v for k, v in python_env().items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    return {**inherited, "TERM": "xterm-256color", **env}


def under_a_terminal(path: Path, **env: str) -> str:
    """What `ralph-run path` writes to a pseudo-terminal, and its exit code checked."""
    main, child = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "ralph_runner", str(path)],
        stdin=subprocess.DEVNULL, stdout=child, stderr=child, env=environment(**env),
    )  # fmt: skip
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert process.wait(30) == 0
    return b"".join(chunks).decode("utf-8", "replace")


def test_a_terminal_gets_colour(tmp_path: Path) -> None:
    shown = under_a_terminal(runbook(tmp_path))
    assert "done: the one item" in shown
    assert SGR.search(shown), shown


def test_no_color_under_a_terminal_gets_no_colour_escape(tmp_path: Path) -> None:
    shown = under_a_terminal(runbook(tmp_path), NO_COLOR="1")
    assert "done: the one item" in shown
    assert not SGR.search(shown), repr(shown)


def test_force_color_in_a_pipe_gets_colour(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(runbook(tmp_path))],
        env=environment(FORCE_COLOR="1"), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "done: the one item" in done.stdout and SGR.search(done.stdout), done.stdout


def test_a_pipe_gets_no_colour(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ralph_runner", str(runbook(tmp_path))],
        env=environment(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "done: the one item" in done.stdout and not SGR.search(done.stdout), done.stdout
