"""`ralph-run RUNBOOK`: run the loop on the one selected host."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Protocol

from ralph_runner.commands import options

if TYPE_CHECKING:
    from ralph_runner import events
    from ralph_runner.output.bus import EventBus
    from ralph_runner.runbook import plan


class Follower(Protocol):
    """Follows the event stream and has a last word when the run ends."""

    def on_event(self, event: events.Event) -> None: ...

    def close(self, code: int) -> None: ...


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ralph-run RUNBOOK`'s options (the top-level parser's; --check hands it to check.py)."""
    options.plan(
        parser,
        json_help="one JSON event per line instead of the human view",
        verbose_help="also show each step's output as it comes (the agent's, for one), secrets "
        "masked",
    )
    parser.add_argument(
        "--forks",
        type=options.positive,
        default=5,
        metavar="N",
        help="with several hosts: at most N loops at once (default 5)",
    )
    parser.add_argument(
        "--workers",
        type=options.workers,
        default=None,
        metavar="N|auto",
        help="checklist items at once, each in its own git worktree, or auto: as many as the "
        "server has headroom for (default: the runbook's loop.workers, 1); see docs/workers.md",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate and print the rendered plan; run and write nothing",
    )


def main(args: argparse.Namespace) -> int:
    # The loop is imported when it runs, not when the parser is built: the run's options are
    # the top-level parser's, so `ralph-run --help` and `--version` would pay for it (0.4 s).
    from ralph_runner import crash
    from ralph_runner.durable.redaction import Redactor
    from ralph_runner.errors import ExitCode, FatalError, Interrupted
    from ralph_runner.fleet import run as fleet
    from ralph_runner.loop.runner import Runner
    from ralph_runner.output.bus import EventBus
    from ralph_runner.output.console import Console
    from ralph_runner.runbook import plan

    plans = plan.build(args.runbook, args.inventory, args.limit, args.extra_vars)
    if len(plans) > 1:
        secrets = [value for p in plans for value in p.secret_values()]
        crash.register(redactor=Redactor(secrets))
        console = Console(json_lines=args.json, verbose=args.verbose)
        return fleet.run(plans, args, EventBus(console, Redactor(secrets)))
    (selected,) = plans
    console = Console(json_lines=args.json, verbose=args.verbose)
    bus = EventBus(console, Redactor(selected.secret_values()))
    followers = _followers(selected, bus)
    code: int = ExitCode.INTERNAL  # what an unexpected exception will exit with
    try:
        runner = Runner(selected, bus, getattr(args, "workers", None))
        crash.register(runner.store, bus.redactor)  # a crash marks this run, masks its secrets
        code = runner.run()
        return code
    except (FatalError, Interrupted) as exc:  # the followers' last word has the exit code
        code = exc.exit_code
        raise
    finally:
        for follower in followers:
            follower.close(code)


def _followers(selected: plan.Plan, bus: EventBus) -> list[Follower]:
    """The metrics textfile and the notifier, when the runbook asks for them (imported only
    then: Apprise alone takes half a second to import)."""
    warn = bus.warn
    found: list[Follower] = []
    if selected.model.metrics is not None:
        from ralph_runner.fleet import metrics

        textfile = metrics.textfile_path(selected)
        if textfile is not None:
            found.append(metrics.Textfile(textfile, selected.host, warn))
    config = selected.model.notify
    if config.to or config.deadman:
        from ralph_runner.fleet import notify

        targets = notify.targets(selected)
        found.append(notify.Notifier(config, targets, selected.host, warn))
    for follower in found:
        bus.follow(follower)
    return found
