"""`ralph-run report WORKDIR|RUNBOOK|RECORDS.jsonl... [-o report.html]`: the deaths as a page."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ralph_runner.commands import options
from ralph_runner.deaths import html as html_report
from ralph_runner.deaths import stats
from ralph_runner.durable.files import NotOurs, check_own_file
from ralph_runner.errors import FatalError, Problem
from ralph_runner.output.text import plural
from ralph_runner.workspace.state_files import STATE_DIR

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run report`'s options: those of `deaths`, and the page's file."""
    options.records(parser)
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="the HTML file (default: a workdir's .ralph/report.html, out of the agent's "
        "repository; else report.html)",
    )


def main(args: argparse.Namespace) -> int:
    output = Path(args.output) if args.output else default_output(args.targets)
    _refused(check_own_file, output)  # before the records are read: a planted link, exit 2
    data = stats.load(args.targets, args.inventory, args.extra_vars)
    answers = _refused(lambda path: html_report.write(data, path), output)
    totals = answers["totals"]
    skipped = f"; {data.skipped.text()}" if data.skipped.total else ""
    print(
        f"report: {output} ({plural(totals['deaths'], 'death')}, "
        f"{plural(totals['iterations'], 'iteration')}, "
        f"{output.stat().st_size / 1e6:.1f} MB){skipped}"
    )
    return 0


def default_output(targets: list[str]) -> Path:
    """In the first target's .ralph/ when it is a workdir: a report.html beside the agent's
    files would be committed by its next iteration."""
    state = Path(targets[0]) / STATE_DIR if targets else None
    return state / "report.html" if state is not None and state.is_dir() else Path("report.html")


def _refused(write: Callable[[Path], T], output: Path) -> T:
    """`write(output)`, its refusal an error (exit 2): a symlink, another user's file, a hard
    link (durable/files.py)."""
    try:
        return write(output)
    except NotOurs as err:
        why = f"will not write the report: it {err.strerror}"
        raise FatalError(Problem(why, str(output))) from None
