"""`ralph-run diagnose RUNBOOK`: run every collector now and print the report; no recovery."""

from __future__ import annotations

import argparse
import json
import time

from ralph_runner.commands import options
from ralph_runner.deaths import log as death_log
from ralph_runner.deaths.record import DeathRecord
from ralph_runner.liveness import diagnostics
from ralph_runner.liveness.service import iso_time
from ralph_runner.runbook import plan
from ralph_runner.workspace import checklist


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run diagnose`'s options."""
    options.plan(
        parser,
        json_help="the report as one JSON object (the death record's fields)",
        verbose_help="accepted as the loop takes it; no effect here",
    )


def main(args: argparse.Namespace) -> int:
    for p in plan.build(args.runbook, args.inventory, args.limit, args.extra_vars):
        model = p.model
        path = p.path(("checklist", "path"), model.checklist.path)
        counts = checklist.counts(checklist.read(path) if path.is_file() else "").as_dict()
        variables = {**p.variables, "phase": "diagnose", "checklist": counts, "deaths": 0}
        group = diagnostics.group_for(p)
        record: DeathRecord = {
            "event": "diagnose",
            "death": 0,
            "time": iso_time(time.time()),
            "host": p.host,
            "runbook": str(p.runbook.path),
            "service": str(p.variables.get("service_name", model.name)),
            "iteration": None,
            "item": None,
            "phase": "diagnose",
            "prompt_size": None,
            "checklist": counts,
            "probes": [],
            "collectors": diagnostics.collect(p.runbook.collectors, group, variables),
        }
        log = death_log.for_plan(p)  # the runbook's own template and secrets; nothing written
        if args.json:
            print(json.dumps(log.redactor.data(record), ensure_ascii=False))
        else:
            print(death_log.render(record, log.template, p.templar, log.redactor, log.where))
    return 0
