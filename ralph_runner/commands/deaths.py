"""`ralph-run deaths RUNBOOK|RECORDS.jsonl`: one line per recorded death, then totals."""

from __future__ import annotations

import argparse
from pathlib import Path

from ralph_runner import loop, plan, reports


def main(args: argparse.Namespace) -> int:
    print(reports.summarize(reports.read_records(records_of(args))))
    return 0


def records_of(args: argparse.Namespace) -> Path:
    """A .jsonl file is read as is; a runbook names its records through `diagnostics`."""
    target = Path(args.target)
    if target.suffix == ".jsonl":
        return target
    (first, *_) = plan.build(target, args.inventory, None, args.extra_vars)
    return loop.death_log_for(first).records_path
