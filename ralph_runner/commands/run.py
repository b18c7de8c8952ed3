"""`ralph-run RUNBOOK`: run the loop on the one selected host."""

from __future__ import annotations

import argparse

from ralph_runner import crash, plan
from ralph_runner.errors import FatalError
from ralph_runner.loop import Interrupted, Runner
from ralph_runner.output import Output
from ralph_runner.reports import Redactor


def main(args: argparse.Namespace) -> int:
    plans = plan.build(args.runbook, args.inventory, args.limit, args.extra_vars)
    if len(plans) > 1:
        hosts = ", ".join(p.host for p in plans)
        raise FatalError(
            f"hosts matches {len(plans)} hosts ({hosts}); a loop serves one host: "
            "choose it with --limit HOST"
        )
    (selected,) = plans
    output = Output(
        json_lines=args.json, verbose=args.verbose, redactor=Redactor(selected.secret_values())
    )
    runner = Runner(selected, output)
    crash.register(runner.store, output.redactor)  # a crash marks this run and masks its secrets
    try:
        return runner.run()
    except Interrupted as exc:
        output.event("interrupted", signal=str(exc), exit_code=exc.exit_code)
        return exc.exit_code
