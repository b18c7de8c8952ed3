"""`ralph-run probe RUNBOOK`: one round of every health probe now; exit 0 healthy, 1 not."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from ralph_runner.commands import options
from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import FatalError
from ralph_runner.liveness.health import for_plan as health_for
from ralph_runner.runbook import plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run probe`'s options."""
    options.plan(
        parser,
        json_help="each probe's result as one JSON object per line",
        verbose_help="accepted as the loop takes it; no effect here",
    )


def main(args: argparse.Namespace) -> int:
    plans = plan.build(args.runbook, args.inventory, args.limit, args.extra_vars)
    healthy = True
    for p in plans:
        if not p.runbook.probes:
            where = p.runbook.where(("health", "probes"))
            raise FatalError(replace(where, message="the runbook declares no health probes"))
        health = health_for(p)
        try:
            results = health.round(None)
        finally:
            health.close()
        healthy = healthy and all(r.ok for r in results)
        redactor = Redactor(p.secret_values())  # a refused probe's detail names its URL
        for r in results:
            if args.json:
                print(json.dumps(redactor.data({"host": p.host, **r.as_dict()})))
            else:
                mark = "ok  " if r.ok else f"FAIL {r.reason}"
                line = f"{p.host}: {mark:<12} {r.name} ({r.kind}, {r.seconds * 1000:.1f} ms)"
                print(redactor.text(line + ("" if r.ok else f": {r.detail}")))
    return 0 if healthy else 1
