"""`ralph-run report WORKDIR|RUNBOOK|RECORDS.jsonl... [-o report.html]`: the deaths as a page."""

from __future__ import annotations

import argparse
from pathlib import Path

from ralph_runner.commands import options
from ralph_runner.deaths import html as html_report
from ralph_runner.deaths import stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run report`'s options: those of `deaths`, and the page's file."""
    options.records(parser)
    parser.add_argument(
        "-o",
        "--output",
        default="report.html",
        metavar="FILE",
        help="the HTML file (default: report.html)",
    )


def main(args: argparse.Namespace) -> int:
    data = stats.load(args.targets, args.inventory, args.extra_vars)
    output = Path(args.output)
    answers = html_report.write(data, output)
    totals = answers["totals"]
    skipped = f"; {data.skipped.text()}" if data.skipped.total else ""
    print(
        f"report: {output} ({totals['deaths']} deaths, {totals['iterations']} iterations, "
        f"{output.stat().st_size / 1e6:.1f} MB){skipped}"
    )
    return 0
