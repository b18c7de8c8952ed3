"""A newcomer's second hour (issue 42): what a new operator met, mended at its cause."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.standin import python_env, ralph

pytestmark = pytest.mark.timeout(60)


def test_status_of_a_workdir_that_does_not_exist_says_so_and_exits_2(tmp_path: Path) -> None:
    """Item 8: "no status ... (never run here?)", exit 1, for a typo in the path; the docs (and
    pause, resume and top) say "no such workdir", exit 2."""
    missing = tmp_path / "no-such-dir"
    shown = ralph("status", str(missing))
    assert shown.returncode == 2, (shown.returncode, shown.stderr)
    assert f"{missing}: no such workdir" in shown.stderr
    never = ralph("status", str(tmp_path))  # it exists: never run here is the right answer
    assert never.returncode == 1 and "never run here" in never.stderr, never.stderr


@pytest.mark.parametrize("module", ["server", "agent"])
def test_the_stand_ins_help_names_the_command_that_runs_it(module: str) -> None:
    """Item 9: the stand-in's `--help` said `usage: server.py`, a file no one can run."""
    shown = subprocess.run(
        [sys.executable, "-m", f"ralph_runner.standin.{module}", "--help"],
        env=python_env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"usage: python -m ralph_runner.standin.{module} ")


def test_deaths_and_report_read_this_directory_and_the_report_stays_out_of_the_repo(
    tmp_path: Path,
) -> None:
    """Item 6: `deaths` and `report` wanted a workdir argument where `status` and `top` take
    `.`, and `report .` wrote report.html into the agent's repository (its next iteration
    committed it): now both default to `.`, and the page goes to the workdir's .ralph/."""
    (tmp_path / ".ralph").mkdir()  # a workdir a run has used, with no death yet
    told = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "deaths"],
        cwd=tmp_path, env=python_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert told.returncode == 0 and "no deaths recorded" in told.stdout, told.stderr
    made = subprocess.run(
        [sys.executable, "-m", "ralph_runner", "report"],
        cwd=tmp_path, env=python_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert (tmp_path / ".ralph" / "report.html").is_file()
    assert not (tmp_path / "report.html").exists()
    assert "report: .ralph/report.html (0 deaths, 0 iterations" in made.stdout, made.stdout
