"""The options that several commands share, each declared once (every command declares its own
in its `add_arguments`, from these and its own)."""

from __future__ import annotations

import argparse


def plan(parser: argparse.ArgumentParser, *, json_help: str, verbose_help: str) -> None:
    """A runbook and what picks its hosts and variables: the run's, probe's and diagnose's."""
    parser.add_argument("runbook", help="the runbook YAML file")
    parser.add_argument("-i", "--inventory", help="Ansible YAML inventory (default: localhost)")
    parser.add_argument("--limit", help="further limit the hosts with an Ansible pattern")
    extra_vars(parser, "extra variables: KEY=VALUE, @file.yaml or JSON; highest precedence")
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument("-v", "--verbose", action="count", default=0, help=verbose_help)


def extra_vars(parser: argparse.ArgumentParser, help: str) -> None:
    """`-e KEY=VALUE|@file|JSON`, as often as wanted."""
    parser.add_argument(
        "-e", "--extra-vars", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def loop_target(parser: argparse.ArgumentParser) -> None:
    """The one loop that status, pause and resume read or write: a workdir or a runbook."""
    parser.add_argument(
        "target",
        nargs="?",
        default=None,
        help="workdir or runbook (default: .; with -i: each host's ralph_workdir)",
    )


def each_host(parser: argparse.ArgumentParser, *, inventory_help: str, timeout: float) -> None:
    """-i, --limit and --timeout: the same on every host of an inventory, over its connection."""
    parser.add_argument("-i", "--inventory", help=inventory_help)
    parser.add_argument("--limit", help="with -i: only the hosts of this Ansible pattern")
    parser.add_argument(
        "--timeout",
        type=float,
        default=timeout,
        help=f"with -i: seconds per host (default {timeout:g})",
    )


def workers(text: str) -> int | str:
    """`--workers`: a whole number of at least 1, or `auto` (argparse's `type`)."""
    return "auto" if text == "auto" else positive(text)


def positive(text: str) -> int:
    """A whole number of at least 1 (argparse's `type`)."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return number


def records(parser: argparse.ArgumentParser) -> None:
    """Where deaths and report find their records: targets, a runbook's hosts and variables."""
    parser.add_argument(
        "targets",
        nargs="*",
        default=["."],
        help="workdirs, runbooks, .jsonl death records or histories (default: this directory)",
    )
    parser.add_argument("-i", "--inventory", help="a runbook's hosts: each one's records")
    extra_vars(
        parser,
        "a runbook's extra variables (KEY=VALUE, @file.yaml or JSON), to find its hosts' "
        "workdirs and records as the run does",
    )


def loop_control(parser: argparse.ArgumentParser) -> None:
    """What pause and resume share after the target: the hosts and the answer's form."""
    each_host(parser, inventory_help="on every host, over its connection", timeout=10.0)
    parser.add_argument(
        "--json",
        action="store_true",
        help="the answer as one JSON object: workdir, what was done, whether a loop runs "
        "(with -i: one per host, in a list)",
    )
