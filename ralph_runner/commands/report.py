"""`ralph-run report WORKDIR|RUNBOOK|RECORDS.jsonl... [-o report.html]`: the deaths as a page."""

from __future__ import annotations

import argparse
from pathlib import Path

from ralph_runner import deathstats, htmlreport


def main(args: argparse.Namespace) -> int:
    data = deathstats.load(args.targets, args.inventory, args.extra_vars)
    output = Path(args.output)
    answers = htmlreport.write(data, output)
    totals = answers["totals"]
    skipped = f"; {data.skipped.text()}" if data.skipped.total else ""
    print(
        f"report: {output} ({totals['deaths']} deaths, {totals['iterations']} iterations, "
        f"{output.stat().st_size / 1e6:.1f} MB){skipped}"
    )
    return 0
