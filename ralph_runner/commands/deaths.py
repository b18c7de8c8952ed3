"""`ralph-run deaths WORKDIR|RUNBOOK|RECORDS.jsonl... [--json]`: what a night of deaths says."""

from __future__ import annotations

import argparse
import json

from ralph_runner.commands import options
from ralph_runner.deaths import stats, text
from ralph_runner.deaths.answers import AnswersWithDeaths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run deaths`'s options."""
    options.records(parser)
    parser.add_argument("--json", action="store_true", help="the answers as one JSON")


def main(args: argparse.Namespace) -> int:
    data = stats.load(args.targets, args.inventory, args.extra_vars)
    answers = stats.tables(data)
    if args.json:
        every: AnswersWithDeaths = {**answers, "deaths": [text.death_row(d) for d in data.deaths]}
        print(json.dumps(every, ensure_ascii=False, default=str))
    else:
        print("\n".join(text.text(answers, data)))
    return 0
