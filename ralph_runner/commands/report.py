"""`ralph-run report WORKDIR|RUNBOOK|RECORDS.jsonl... [-o report.html]`: the deaths as a page."""

from __future__ import annotations

import argparse
from pathlib import Path

from ralph_runner.deaths import html as html_report
from ralph_runner.deaths import stats


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
