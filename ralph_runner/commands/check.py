"""`ralph-run RUNBOOK --check`: validate everything, print the rendered plan, run nothing.

Nothing of the runbook runs and nothing is written: tasks are rendered through their action's
`describe`, probes and collectors are rendered, the prompt is rendered with the first item (pipe
lookups not run) and shown as written. What the run checks of its workdir before its first
iteration is checked here too (runbook/preflight.py: the workdir, the checklist, a git
repository for `verify`, for which git is asked read-only).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any

import yaml

from ralph_runner import crash, template_errors, templating
from ralph_runner.commands import check_warnings
from ralph_runner.deaths import log as deaths_log
from ralph_runner.deaths import wiring
from ralph_runner.durable.redaction import Redactor
from ralph_runner.errors import FatalError, Problem
from ralph_runner.fleet import run as fleet
from ralph_runner.liveness import recovery
from ralph_runner.liveness.health import probe_specs
from ralph_runner.loop import proxy
from ralph_runner.probes import progress as progress_probe
from ralph_runner.runbook import loader, plan, preflight, tasks
from ralph_runner.workspace import checklist

PROMPT_PLACEHOLDER = "<the prompt, rendered each iteration>"
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's, if installed: 10x faster


def main(args: argparse.Namespace) -> int:
    plans = plan.build(args.runbook, args.inventory, args.limit, args.extra_vars, check=True)
    crash.register(redactor=Redactor([s for p in plans for s in p.secret_values()]))
    fleet.check_distinct(plans)
    checked = [_render(p) for p in plans]
    rendered = [result for result, _ in checked]
    for p, (_, said) in zip(plans, checked, strict=True):
        host = f"{p.host}: " if len(plans) > 1 else ""
        for line in said:  # a warning leaves the exit at 0 (docs: troubleshooting)
            print(f"ralph-run: warning: {host}{line}", file=sys.stderr)
    if args.json:
        print(json.dumps(rendered, indent=2, ensure_ascii=False, default=str))
    else:
        for one in rendered:
            print(yaml.dump(one, Dumper=_DUMPER, sort_keys=False, allow_unicode=True, width=100))
    return 0


def _render(p: plan.Plan) -> tuple[dict[str, object], list[str]]:
    """The rendered plan of one host, and its warnings (check_warnings.py)."""
    model = p.model
    redactor = Redactor(p.secret_values())
    problems: list[FatalError] = []
    try:  # what would stop the run at once: the workdir, its checklist, its repository
        found = preflight.problems(p) + deaths_log.unsafe(p)
    except FatalError as exc:  # a template error in checklist.path
        found = exc.problems
    if found:
        problems.append(FatalError(found))
    try:
        variables = _iteration_vars(p)
    except FatalError as exc:  # a checklist that cannot be read: the run fails on it too
        problems.append(exc)
        variables = _iteration_vars(p, read=False)

    registered = dict.fromkeys(_registered(p))
    commands: list[check_warnings.RunsHere] = []  # the commands the run will start

    def each(
        specs, group: tasks.TaskGroup, scope: dict[str, object], block: str | None = None
    ) -> list[dict[str, object]]:
        out = []
        for spec in specs:
            if block is not None:
                commands.append(check_warnings.RunsHere(block, spec, group, scope))
            try:
                _check_names(p, spec, {**scope, **registered})
                out.append(
                    {
                        "name": spec.name,
                        spec.kind: tasks.describe(spec, group, scope),
                        **({"when": spec.task.when} if spec.task.when is not None else {}),
                        **({"timeout": spec.task.timeout} if spec.task.timeout else {}),
                        **(
                            {"idle_timeout": spec.task.idle_timeout}
                            if spec.task.idle_timeout
                            else {}
                        ),
                    }
                )
            except FatalError as exc:
                problems.append(exc)
        return out

    at_death = {**variables, "death": recovery.SAMPLE_DEATH}  # collectors and recovery see it
    controller = tasks.TaskGroup(p, connection=p.controller(), cwd=p.workdir)
    target = tasks.TaskGroup(p, timeout=model.diagnostics.timeout)
    try:
        probes = [
            {"name": s.name, s.kind: _dump(s.params), "timeout": s.timeout, "every": s.every}
            for s in probe_specs(p)
        ]
    except FatalError as exc:
        problems.append(exc)
        probes = []
    death_log = p.path(("diagnostics", "log"), model.diagnostics.log)
    result = {
        "runbook": str(p.runbook.path),
        "name": model.name,
        "host": p.host,
        "connection": p.connection_for(None).name,
        "workdir": str(p.workdir),
        "checklist": str(p.path(("checklist", "path"), model.checklist.path)),
        "variables": {k: v for k, v in p.variables.items() if k != "env"},
        "prompt": model.prompt,
        "loop": {
            "max_iterations": model.loop.max_iterations,
            "workers": _workers(model.loop),
            "proxy": _proxy(model.loop),
            "steps": each(p.runbook.loop_steps, controller, variables, "loop"),
        },
        "health": {
            **model.health.model_dump(exclude={"probes"}),
            "probes": probes,
            **_hang_bound(model.health, probe_specs(p) if probes else []),
        },
        "diagnostics": {
            "log": str(death_log),
            "timeout": model.diagnostics.timeout,
            "collect": each(p.runbook.collectors, target, at_death),
        },
        "recovery": {
            **model.recovery.model_dump(exclude={"steps"}),
            "steps": each(p.runbook.recovery_steps, target, at_death, "recovery"),
        },
        "recorder": _recorder(p, problems),
    }
    blocks = [("pause", p.runbook.pause_steps), ("resume", p.runbook.resume_steps)]
    blocks += [("setup", p.runbook.setup_steps), ("teardown", p.runbook.teardown_steps)]
    for block, specs in blocks:
        if specs:  # run on the target at a pause, its resume (loop/pause.py), the run's start
            # and its end (loop/lifecycle.py)
            result[block] = each(specs, target, {**variables, "phase": block}, block)
    try:
        result.update(_followers(p))
    except FatalError as exc:
        problems.append(exc)
    try:
        _check_prompt(p, variables)
    except FatalError as exc:
        problems.append(exc)
    if problems:
        raise FatalError([problem for exc in problems for problem in exc.problems])
    said = [redactor.text(line) for line in check_warnings.warnings(p, commands)]
    return redactor.data(_plain(result)), said


def _workers(loop: Any) -> str:
    """`loop.workers` in words: how many items at once, and where each one is worked on."""
    if loop.workers == "auto":
        return (
            f"auto: as many items at once as the server has headroom for, up to"
            f" {loop.max_workers}, each in its own git worktree (docs: workers)"
        )
    if loop.workers == 1:
        return "1: one item at a time, in the workdir"
    return f"{loop.workers}: items at once, each in its own git worktree (docs: workers)"


def _proxy(loop: Any) -> str:
    """`loop.proxy` in words: whether the agent's requests are counted, and how to point it."""
    if not loop.proxy:
        return "off: the agent talks to the server directly; no receipts per iteration"
    return (
        "on: the agent's requests go through a loopback proxy ({{ agent_base_url }}) that"
        " counts this loop's own tokens (each iteration's receipt)"
    )


def _recorder(p: plan.Plan, problems: list[FatalError]) -> dict[str, object] | None:
    """The flight recorder as it would run: its URL and follow command rendered."""
    try:
        settings = wiring.settings_for(p)
    except FatalError as exc:
        problems.append(exc)
        return None
    if settings is None:
        return None
    shown = {k: v for k, v in vars(settings).items() if k != "connection"}
    return {**shown, "file": settings.file and str(settings.file), "on": settings.connection.name}


def _followers(p: plan.Plan) -> dict[str, object]:
    """The metrics textfile and the notification targets, rendered and checked."""
    shown: dict[str, object] = {}
    if p.model.metrics is not None:
        from ralph_runner.fleet import metrics

        shown["metrics"] = {"textfile": str(metrics.textfile_path(p))}
    config = p.model.notify
    if config.to or config.deadman:
        from ralph_runner.fleet import notify

        targets = notify.targets(p)
        shown["notify"] = {
            "to": [{"url": url, "events": sorted(events)} for url, events in targets.to],
            "deadman": targets.deadman,
            "timeout": config.timeout,
            "retries": config.retries,
        }
    return shown


def _registered(p: plan.Plan) -> set[str]:
    """Every `register:` name of the runbook: a `when:` may test a result registered before."""
    runbook = p.runbook
    specs = [*runbook.loop_steps, *runbook.collectors, *runbook.recovery_steps]
    specs += [*runbook.pause_steps, *runbook.resume_steps]
    specs += [*runbook.setup_steps, *runbook.teardown_steps]
    return {spec.task.register_ for spec in specs if spec.task.register_}


def _check_names(p: plan.Plan, spec: loader.TaskSpec, scope: dict[str, object]) -> None:
    """A `when:` or `until:` naming what no variable, no iteration fact and no `register:`
    defines would fail at the iteration that first evaluates it: fail now, at its line."""
    scope = {**scope, **spec.vars, **spec.task.vars}
    for keyword in ("when", "until"):
        expression = getattr(spec.task, keyword)
        if isinstance(expression, str):
            text = expression if templating.has_template(expression) else f"{{{{ {expression} }}}}"
            _require_known(p, text, scope, spec.where_of(keyword))


def _require_known(p: plan.Plan, text: str, scope: dict[str, object], where: Problem) -> None:
    missing = sorted(p.templar.undefined_names(text, scope, where=where))
    if missing:
        names = ", ".join(repr(name) for name in missing)
        message = f"undefined variable {names}: no var, iteration fact or register defines it"
        close = template_errors.closest(missing[0], scope) if len(missing) == 1 else None
        message += f"; did you mean {close!r}?" if close else ""
        raise FatalError(replace(where, message=message))


def _check_prompt(p: plan.Plan, variables: dict[str, object]) -> None:
    """The prompt rendered as the first iteration renders it, with its item (or a sample
    one): `{{ item.txt }}` fails here, at the prompt's line, as it would fail the run. Pipe
    lookups are not run (the templar's check mode); the plan shows the prompt as written."""
    where = p.runbook.where(("prompt",))
    _require_known(p, p.model.prompt, variables, where)
    p.templar.render(p.model.prompt, variables, where=where)


def _iteration_vars(p: plan.Plan, read: bool = True) -> dict[str, object]:
    """Per-iteration variables as the first iteration would see them (read-only)."""
    path = p.path(("checklist", "path"), p.model.checklist.path)
    text = checklist.read(path) if read and checklist.present(path) else ""
    item = checklist.next_todo(text)
    item_vars = (
        {"text": item.text, "line": item.line, "index": item.index, "attempts": 0, "deaths": 0}
        if item
        else {"text": "<next checklist item>", "line": 0, "index": 0, "attempts": 0, "deaths": 0}
    )
    return {
        **p.variables,
        "iteration": 1,
        "item": item_vars,
        "checklist": checklist.counts(text).as_dict(),
        "deaths": 0,
        "phase": "start",
        "prompt": PROMPT_PLACEHOLDER,
        "prompt_size": 0,
        "prompt_bytes": 0,
        **proxy.variables(p, None),  # agent_base_url: the direct URL here (no proxy runs)
    }


def _plain(value: Any) -> Any:
    """Data YAML and JSON can print: a variable may render to anything (`{{ range }}` is a
    function), which the plan shows as text rather than failing to print."""
    if isinstance(value, dict):
        return {_plain_key(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _plain_key(key: Any) -> Any:
    return key if isinstance(key, str | int | float | bool) else str(key)


def _dump(params: Any) -> Any:
    return params.model_dump() if hasattr(params, "model_dump") else params


def _hang_bound(health: Any, specs: list[Any]) -> dict[str, str]:
    """The hang bound B and the worst case from a hang to its death (docs: hangs, "The
    detection bound"): watch + B rounded up to whole watch periods + failures_before_dead x the
    longest probe timeout + the intervals, from B's floor to its ceiling."""
    limits = [s.params.limits() for s in specs if s.kind == "progress"]
    if not limits or not health.watch:
        return {}
    watch, rounds = float(health.watch), health.failures_before_dead
    longest = max(float(s.timeout) for s in specs)
    floor, ceiling = max(b.floor for b in limits), max(b.ceiling for b in limits)
    margin = max(b.margin for b in limits)

    def found(stall: float) -> float:
        whole = math.ceil(stall / watch) * watch
        return watch + whole + rounds * longest + (rounds - 1) * health.interval

    formula = f"{watch:g} + B rounded up to {watch:g} s + {rounds} x {longest:g}"
    formula += f" + {rounds - 1} x {health.interval:g}"
    if floor == ceiling:
        return {
            "hang_bound": f"B = {floor:g} s (stall_after)",
            "hang_found_within": f"{found(floor):g} s ({formula})",
        }
    progress = [s.params for s in specs if s.kind == "progress"]
    calibrates = any(p.calibrate and p.completion is not None for p in progress)
    histograms = ", ".join((p.prefill or progress_probe.Prefill()).seconds for p in progress)
    sources = [
        f"the engine's histograms ({histograms})",
        "this loop's streamed requests",
        *(["a calibration request at the run's first idle check"] if calibrates else []),
        "this loop's whole answers (an upper bound)",
    ]
    learned = (
        f"B = {margin:g} x the slowest engine step seen, or while a prompt of the loop's awaits"
        " its first step, its tokens x the pace of the first of: " + "; ".join(sources) + ";"
        f" none measured: the ceiling; within [{floor:g}, {ceiling:g}] s;"
        " its value now, and which source set it: `ralph-run status`"
    )
    return {
        "hang_bound": learned,
        "hang_found_within": f"{found(floor):g} to {found(ceiling):g} s ({formula})",
    }
